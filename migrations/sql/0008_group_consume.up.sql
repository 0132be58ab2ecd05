-- Group commit for consumes: _consume_batch leases for several requests in one
-- transaction (the function comes from fastpubsub/sql/consume.sql once the
-- database is at the head).
SELECT 1;
