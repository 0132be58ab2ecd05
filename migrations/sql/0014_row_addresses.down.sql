-- Back to revision 0013_publish_handoff: the two functions this revision's
-- upgrade changed lose their SET enable_seqscan = off, which leaves each
-- exactly as revision 0013_publish_handoff had it.

ALTER FUNCTION fastpubsub._drop_oldest(fastpubsub.subscriptions,bigint) RESET enable_seqscan;
ALTER FUNCTION fastpubsub._lease(text,text[],integer[]) RESET enable_seqscan;
