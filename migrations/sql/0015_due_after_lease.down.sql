-- Back to revision 0014_lease_fixes: it had no _next_due_after_lease (its
-- server's consume_events called next_due itself).
DROP FUNCTION fastpubsub._next_due_after_lease(text);
