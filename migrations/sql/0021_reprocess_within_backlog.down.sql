-- Back to revision 0020_repeated_receipt_nacks: reprocess_dlq as that
-- revision had it (dead letters join the backlog whatever its max_backlog).

CREATE OR REPLACE FUNCTION fastpubsub.reprocess_dlq(p_subscription_id text, p_ids uuid[])
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    n integer;
BEGIN
    PERFORM fastpubsub._settle_exhausted(s);
    PERFORM pg_current_xact_id();  -- before drawing queue numbers (see _advance_watermark)
    UPDATE fastpubsub.deliveries AS d
    SET status = 'available', seq = nextval('fastpubsub.delivery_seq'), attempts = 0, visible_at = now(),
        lease_until = NULL, leased_at = NULL, consumer_id = NULL
    WHERE d.subscription_key = s.key AND d.message_id = ANY (p_ids) AND d.status = 'dlq';
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 AND s.max_backlog IS NOT NULL THEN
        PERFORM fastpubsub._count(s.key, n, 0, 0);
    END IF;
    IF n > 0 THEN
        PERFORM fastpubsub._notify(ARRAY[s.id], ARRAY[n]);
    END IF;
    RETURN n;
END
$$;
