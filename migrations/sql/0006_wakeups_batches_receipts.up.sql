-- Wake-ups off the commit path, group commit, and lease receipts.
--
-- * _notify names each subscription with how many messages it can deliver
--   (`orders=3`) and does nothing in sessions that set fastpubsub.notify =
--   off: the server's own, which wake their waiters after the commit and tell
--   other processes with one coalesced notification outside the transaction.
-- * _publish returns the subscriptions it fed with those counts, and takes an
--   id offset so that _publish_batch (several requests, one transaction) keeps
--   ids in order; _settle_batch does the same for acks, nacks and lease
--   extensions.
-- * consume returns each lease's receipt (and _message_json renders it);
--   ack_receipts, nack_receipts (with requeue = false: straight to the DLQ)
--   and extend_lease_receipts act only on the lease a receipt names.
-- The functions themselves come from fastpubsub/sql once the database is at
-- the head; here only what changes signature is dropped.

DROP FUNCTION IF EXISTS fastpubsub._notify(text[]);
DROP FUNCTION IF EXISTS fastpubsub._publish(text, jsonb, boolean);
DROP FUNCTION IF EXISTS fastpubsub._message_json(uuid, text, jsonb, integer, timestamptz, jsonb, smallint);
DROP FUNCTION IF EXISTS fastpubsub.consume(text, text, integer);
