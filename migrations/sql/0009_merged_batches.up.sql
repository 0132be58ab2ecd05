-- Group commit writes the requests of one topic or subscription together:
-- _publish_batch publishes a topic's requests with one _publish, _lease
-- leases to several consumers in one statement (consume and _consume_batch
-- use it), and _settle_batch settles alike requests of a subscription at
-- once, matching receipts through _held_receipts, which replaces
-- _held_leases. The batch functions and the ones they call use generic plans
-- (planning cost more than running). The functions come from fastpubsub/sql
-- once the database is at the head.
DROP FUNCTION IF EXISTS fastpubsub._held_leases(integer, text[]);
