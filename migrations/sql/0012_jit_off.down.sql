-- Back to revision 0011_push: the functions this revision's upgrade changed
-- lose their SET jit = off, which leaves each exactly as revision 0011_push
-- had it (the only difference pg_get_functiondef shows between a database at
-- 0011_push and one at this revision).

ALTER FUNCTION fastpubsub._advance_watermark(fastpubsub.subscriptions) RESET jit;
ALTER FUNCTION fastpubsub._cleanup_retention(integer) RESET jit;
ALTER FUNCTION fastpubsub._consume_batch(text[],text[],integer[]) RESET jit;
ALTER FUNCTION fastpubsub._delete_orphan_messages(integer[],uuid[]) RESET jit;
ALTER FUNCTION fastpubsub._drop_oldest(fastpubsub.subscriptions,bigint) RESET jit;
ALTER FUNCTION fastpubsub._lease(text,text[],integer[]) RESET jit;
ALTER FUNCTION fastpubsub._next_priority(integer,smallint) RESET jit;
ALTER FUNCTION fastpubsub._publish(text,jsonb,boolean,bigint) RESET jit;
ALTER FUNCTION fastpubsub._publish_batch(text[],text[],boolean[]) RESET jit;
ALTER FUNCTION fastpubsub._settle_batch(jsonb) RESET jit;
ALTER FUNCTION fastpubsub.ack(text,uuid[]) RESET jit;
ALTER FUNCTION fastpubsub.backfill(text,integer) RESET jit;
ALTER FUNCTION fastpubsub.cleanup_idempotency_keys(integer,integer) RESET jit;
ALTER FUNCTION fastpubsub.extend_lease(text,uuid[],integer) RESET jit;
ALTER FUNCTION fastpubsub.nack(text,uuid[]) RESET jit;
ALTER FUNCTION fastpubsub.next_due(text) RESET jit;
ALTER FUNCTION fastpubsub.peek(text,integer) RESET jit;
ALTER FUNCTION fastpubsub.subscription_metrics(text) RESET jit;
ALTER FUNCTION fastpubsub.topic_stats(text) RESET jit;
