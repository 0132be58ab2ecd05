-- Publishing can hand its new messages to consumers waiting in the publishing
-- server process, leased in the same transaction (_publish_handoff). A new
-- function only: no table changes; the functions are installed from the
-- source at the head.
SELECT 1;
