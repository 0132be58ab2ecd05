-- An ack by receipt whose answer was lost, sent again, found the lease
-- settled by that very ack and was answered 'lease not held': clients
-- counted as lost a message that was acked. acked_deliveries now keeps when
-- the lease it settled was taken (leased_at; NULL for rows acked before this
-- revision and for those seek acks), and _settle_batch answers such a repeat
-- 'acknowledged' again, counting it once. _ack_rows stores the time.
--
-- The new column has no default: adding it rewrites nothing. The functions
-- are installed from the source at the head.

ALTER TABLE fastpubsub.acked_deliveries ADD COLUMN leased_at timestamptz;
