-- _lease and _drop_oldest say SET enable_seqscan = off. Both change rows they
-- found by address (ctid = ANY of an array). A generic plan costs such a
-- lookup with a guessed array length, so a plan made while the deliveries
-- table was small read the whole table instead, on every call, for the life of
-- the connection, however large the table grew meanwhile (docs/schema.md,
-- "Plans that last"). No table changes: the functions are installed from the
-- source at the head.
SELECT 1;
