-- Back to the previous definitions of the hot-path helpers.

CREATE OR REPLACE FUNCTION fastpubsub._message_id(p_time timestamptz, p_offset bigint)
RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$
    SELECT encode(
        substring(int8send(t.units >> 12) FROM 3 FOR 6)
        || substring(int4send(((t.units & 4095) | 28672)::integer) FROM 3 FOR 2)
        || substring(uuid_send(gen_random_uuid()) FROM 9 FOR 8),
        'hex')::uuid
    FROM (SELECT (extract(epoch FROM p_time) * 4096000)::bigint + p_offset AS units) AS t
$$;

CREATE OR REPLACE FUNCTION fastpubsub._next_priority(p_subscription_key integer, p_below smallint)
RETURNS smallint
LANGUAGE sql STABLE
SET enable_sort = off
SET enable_bitmapscan = off
AS $$
    SELECT d.priority FROM fastpubsub.deliveries AS d
    WHERE d.subscription_key = p_subscription_key AND d.status = 'available'
      AND d.priority < coalesce(p_below, 32767)  -- a range the index seeks to, never a filter
    ORDER BY d.priority DESC
    LIMIT 1
$$;

CREATE OR REPLACE FUNCTION fastpubsub._held(p_subscription_key integer, p_ids uuid[])
RETURNS tid[]
LANGUAGE sql STABLE
AS $$
    SELECT coalesce(array_agg(h.row_id), '{}')
    FROM unnest(p_ids) AS x(id)
    CROSS JOIN LATERAL (
        SELECT d.ctid AS row_id FROM fastpubsub.deliveries AS d
        WHERE d.subscription_key = p_subscription_key AND d.message_id = x.id AND d.lease_until IS NOT NULL
        LIMIT 1
    ) AS h
$$;

-- Lease up to p_batch_size messages to p_consumer_id for the subscription's ack
-- deadline. Leases that ran out count as a failed attempt: they are delivered
-- again, or dead-lettered once max_delivery_attempts is used up. Rows locked by
-- a concurrent consume are skipped, never waited for.
CREATE OR REPLACE FUNCTION fastpubsub.consume(p_subscription_id text, p_consumer_id text, p_batch_size integer)
RETURNS TABLE (id uuid, payload jsonb, attempts integer, created_at timestamptz)
LANGUAGE plpgsql
-- Each query here is meant to walk an index in order. Right after a bulk load
-- the statistics can claim the table is tiny, and a planner that believes them
-- sorts the whole backlog instead: these settings keep the index plans.
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_mergejoin = off
SET enable_hashjoin = off
AS $$
#variable_conflict use_column
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    v_now timestamptz := now();
    v_lease_until timestamptz;
    v_ids uuid[] := '{}';
    v_attempts integer[] := '{}';
    v_more_ids uuid[];
    v_more_attempts integer[];
    v_dead integer;
    v_first_seq bigint;
BEGIN
    IF p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 1000 THEN
        RAISE EXCEPTION 'batch size must be between 1 and 1000' USING ERRCODE = 'FP422';
    END IF;
    IF p_consumer_id IS NULL OR length(p_consumer_id) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'consumer id must be 1 to 200 characters' USING ERRCODE = 'FP422';
    END IF;
    v_lease_until := v_now + make_interval(secs => s.ack_deadline_seconds);

    -- 1. Retries whose backoff is over.
    WITH due AS MATERIALIZED (
        SELECT d.ctid AS row_id
        FROM fastpubsub.deliveries AS d
        WHERE d.subscription_key = s.key AND d.status = 'scheduled' AND d.visible_at <= v_now
        ORDER BY d.visible_at
        LIMIT p_batch_size
        FOR UPDATE SKIP LOCKED
    ), leased AS (
        -- Locking the rows above gave this transaction its id before nextval runs.
        UPDATE fastpubsub.deliveries AS d
        SET status = 'available', seq = nextval('fastpubsub.delivery_seq'), attempts = d.attempts + 1,
            lease_until = v_lease_until, leased_at = v_now, consumer_id = p_consumer_id
        WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM due))
        RETURNING d.seq, d.message_id, d.attempts
    )
    SELECT coalesce(array_agg(message_id ORDER BY seq), '{}'), coalesce(array_agg(attempts ORDER BY seq), '{}')
    INTO v_ids, v_attempts
    FROM leased;

    -- 2. Oldest first among messages nobody holds, including leases that ran
    --    out: those count as a failed attempt and are dead-lettered when no
    --    attempt is left. Dead-lettering does not fill the batch, so go on
    --    until the batch is full or nothing more comes.
    LOOP
        EXIT WHEN cardinality(v_ids) >= p_batch_size;
        WITH ready AS MATERIALIZED (
            SELECT d.ctid AS row_id, d.seq,
                   (d.lease_until IS NOT NULL AND d.attempts >= s.max_delivery_attempts) AS exhausted
            FROM fastpubsub.deliveries AS d
            WHERE d.subscription_key = s.key AND d.status = 'available' AND d.seq >= s.consume_from
              AND (d.lease_until IS NULL OR d.lease_until <= v_now)
            ORDER BY d.seq
            LIMIT p_batch_size - cardinality(v_ids)
            FOR UPDATE SKIP LOCKED
        ), dead AS (
            UPDATE fastpubsub.deliveries AS d
            SET status = 'dlq', visible_at = v_now, lease_until = NULL, leased_at = NULL, consumer_id = NULL
            WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM ready WHERE exhausted))
            RETURNING 1
        ), leased AS (
            UPDATE fastpubsub.deliveries AS d
            SET attempts = d.attempts + 1, lease_until = v_lease_until, leased_at = v_now,
                consumer_id = p_consumer_id
            WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM ready WHERE NOT exhausted))
            RETURNING d.seq, d.message_id, d.attempts
        )
        SELECT (SELECT count(*) FROM dead),
               coalesce((SELECT array_agg(message_id ORDER BY seq) FROM leased), '{}'),
               coalesce((SELECT array_agg(attempts ORDER BY seq) FROM leased), '{}'),
               least(v_first_seq, (SELECT min(seq) FROM ready))
        INTO v_dead, v_more_ids, v_more_attempts, v_first_seq;
        v_ids := v_ids || v_more_ids;
        v_attempts := v_attempts || v_more_attempts;
        EXIT WHEN v_dead = 0;
    END LOOP;

    IF v_first_seq - s.consume_from > 1000 OR s.consume_from_candidate IS NOT NULL THEN
        PERFORM fastpubsub._advance_watermark(s);
    END IF;

    -- Queue order: due retries first, then oldest first.
    RETURN QUERY
        SELECT m.id, m.payload, x.attempts, m.created_at
        FROM unnest(v_ids, v_attempts) WITH ORDINALITY AS x(message_id, attempts, ord)
        CROSS JOIN LATERAL (
            -- LIMIT keeps this a lookup per row: as a plain join the planner
            -- may merge-join against the topic's whole message history.
            SELECT m.id, m.payload, m.created_at FROM fastpubsub.messages AS m
            WHERE m.topic_key = s.topic_key AND m.id = x.message_id
            LIMIT 1
        ) AS m
        ORDER BY x.ord;
END
$$;
