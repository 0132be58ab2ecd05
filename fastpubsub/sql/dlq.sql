-- The dead-letter queue: list and reprocess.

-- Dead-lettered messages, oldest first, in the row shape consume returns.
CREATE OR REPLACE FUNCTION fastpubsub.list_dlq(p_subscription_id text, p_offset integer, p_limit integer)
RETURNS TABLE(id uuid, payload jsonb, attributes jsonb, priority smallint, attempts integer,
              created_at timestamptz)
LANGUAGE plpgsql
AS $$
#variable_conflict use_column
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
BEGIN
    IF p_offset IS NULL OR p_offset < 0 OR p_limit IS NULL OR p_limit < 1 OR p_limit > 1000 THEN
        RAISE EXCEPTION 'offset must be >= 0 and limit between 1 and 1000' USING ERRCODE = 'FP422';
    END IF;
    PERFORM fastpubsub._settle_exhausted(s);
    RETURN QUERY
        SELECT m.id, m.payload, m.attributes, m.priority, d.attempts, m.created_at
        FROM (
            SELECT d.message_id, d.attempts FROM fastpubsub.deliveries AS d
            WHERE d.subscription_key = s.key AND d.status = 'dlq'
            ORDER BY d.message_id
            OFFSET p_offset LIMIT p_limit
        ) AS d
        CROSS JOIN LATERAL (
            SELECT m.id, m.payload, m.attributes, m.priority, m.created_at FROM fastpubsub.messages AS m
            WHERE m.topic_key = s.topic_key AND m.id = d.message_id
            LIMIT 1
        ) AS m
        ORDER BY d.message_id;
END
$$;

-- Make dead-lettered messages deliverable again with a fresh attempt count.
-- They join the backlog: past the subscription's max_backlog, its
-- backlog_policy applies as to a publish (drop_oldest makes room, reject
-- refuses with FP429 and nothing is reprocessed). Holds the subscription's
-- backlog lock (as _make_room does) while it counts.
CREATE OR REPLACE FUNCTION fastpubsub.reprocess_dlq(p_subscription_id text, p_ids uuid[])
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    n integer;
    v_backlog bigint;
    v_excess bigint;
    v_dropped bigint := 0;
BEGIN
    PERFORM fastpubsub._settle_exhausted(s);
    IF s.max_backlog IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(1718645603, s.key);
    END IF;
    PERFORM pg_current_xact_id();  -- before drawing queue numbers (see _advance_watermark)
    UPDATE fastpubsub.deliveries AS d
    SET status = 'available', seq = nextval('fastpubsub.delivery_seq'), attempts = 0, visible_at = now(),
        lease_until = NULL, leased_at = NULL, consumer_id = NULL
    WHERE d.subscription_key = s.key AND d.message_id = ANY (p_ids) AND d.status = 'dlq';
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 AND s.max_backlog IS NOT NULL THEN
        SELECT coalesce(max(c.backlog), 0) INTO v_backlog
        FROM fastpubsub.subscription_counts AS c WHERE c.subscription_key = s.key;
        v_excess := v_backlog + n - s.max_backlog;
        IF v_excess > 0 AND s.backlog_policy = 'drop_oldest' THEN
            v_dropped := fastpubsub._drop_oldest(s, v_excess);
        END IF;
        IF v_excess > v_dropped THEN
            RAISE EXCEPTION 'subscription "%" is full: % messages in its backlog, max_backlog %, % more reprocessed%; '
                            'nothing was reprocessed', s.id, v_backlog, s.max_backlog, n,
                            CASE WHEN s.backlog_policy = 'drop_oldest'
                                 THEN format(', and only %s could be dropped (leased ones never are)', v_dropped)
                                 ELSE '' END
                USING ERRCODE = 'FP429', DETAIL = s.id;
        END IF;
        PERFORM fastpubsub._count(s.key, n - v_dropped, 0, v_dropped);
    END IF;
    IF n > 0 THEN
        PERFORM fastpubsub._notify(ARRAY[s.id], ARRAY[n]);
    END IF;
    RETURN n;
END
$$;