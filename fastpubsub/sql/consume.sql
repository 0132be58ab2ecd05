-- Consuming: leasing messages, and what long-polls and streams need to wait well.

-- Move a subscription's consume watermark forward.
--
-- Acked and leased-away rows leave dead entries at the head of the available
-- index until VACUUM removes them, and every consume would step over all of
-- them. The watermark lets consume seek past them instead. It is safe because
-- a row only ever enters the available state with a newly drawn seq, so the
-- smallest live seq never decreases -- except that a transaction which drew a
-- seq but has not committed yet is invisible. Hence two phases:
--   1. note the smallest visible live seq (over every priority) as a
--      candidate, together with the xmax of the current snapshot;
--   2. once every transaction that was running then has ended (the oldest
--      running xid has passed that xmax), every row below the candidate that
--      will ever be live is visible, so the watermark becomes the smallest
--      visible live seq below the candidate, or the candidate itself.
-- Writers take their transaction id before drawing seqs, so a transaction that
-- starts later can only draw larger ones. Concurrent consumers skip the
-- subscription row when another one is updating it: never a wait.
CREATE OR REPLACE FUNCTION fastpubsub._advance_watermark(s fastpubsub.subscriptions)
RETURNS void
LANGUAGE plpgsql
SET enable_sort = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    v_min bigint;
    v_seq bigint;
    v_priority smallint;
    v_upper bigint;
BEGIN
    IF s.consume_from_candidate IS NOT NULL
       AND pg_snapshot_xmin(pg_current_snapshot()) < s.consume_from_candidate_xmax THEN
        RETURN;  -- transactions that were running when the candidate was noted still run
    END IF;
    v_upper := coalesce(s.consume_from_candidate, 9223372036854775807);
    v_priority := fastpubsub._next_priority(s.key, NULL);
    WHILE v_priority IS NOT NULL LOOP
        SELECT d.seq INTO v_seq FROM fastpubsub.deliveries AS d
        WHERE d.subscription_key = s.key AND d.status = 'available' AND d.priority = v_priority
          AND d.seq >= s.consume_from AND d.seq < v_upper
        ORDER BY d.seq LIMIT 1;
        IF v_seq IS NOT NULL AND (v_min IS NULL OR v_seq < v_min) THEN
            v_min := v_seq;
        END IF;
        v_priority := fastpubsub._next_priority(s.key, v_priority);
    END LOOP;
    IF s.consume_from_candidate IS NULL THEN
        IF v_min IS NULL OR v_min <= s.consume_from THEN
            RETURN;
        END IF;
        UPDATE fastpubsub.subscriptions AS x
        SET consume_from_candidate = v_min,
            consume_from_candidate_xmax = pg_snapshot_xmax(pg_current_snapshot())
        WHERE x.ctid = (SELECT y.ctid FROM fastpubsub.subscriptions AS y
                        WHERE y.key = s.key FOR NO KEY UPDATE SKIP LOCKED)
          AND x.consume_from_candidate IS NULL;
    ELSE
        UPDATE fastpubsub.subscriptions AS x
        SET consume_from = greatest(x.consume_from, coalesce(v_min, s.consume_from_candidate)),
            consume_from_candidate = NULL,
            consume_from_candidate_xmax = NULL
        WHERE x.ctid = (SELECT y.ctid FROM fastpubsub.subscriptions AS y
                        WHERE y.key = s.key FOR NO KEY UPDATE SKIP LOCKED)
          AND x.consume_from_candidate = s.consume_from_candidate;
    END IF;
END
$$;

-- Lease messages of one subscription to several consumers at once: p_sizes[k]
-- to p_consumers[k], for the subscription's ack deadline, each counting one
-- delivery attempt:
-- 1. scheduled rows whose time has come (retries after their backoff, delayed
--    messages) join the back of their priority's queue (a new seq), or go to
--    the DLQ when no attempt is left;
-- 2. the highest priority first; within one, queue order among rows nobody
--    holds, including leases that ran out (a failed attempt; dead-lettered
--    when none is left, which does not fill the batch).
-- Rows other consumers are leasing right now are skipped, never waited for.
-- Consumer k gets the rows after those of consumers 1 .. k-1 (`slot` k), so
-- one statement serves many small requests (group commit) as it would one
-- large one. Each row carries the receipt of its lease (see _receipt).
-- A subscription with a message TTL, or that was sent messages with their own
-- expiry, takes its rows through a second form of step 2 that also reads
-- their expiry: expired rows it meets are taken out for good (_expire_rows)
-- and do not fill the batch, so each is looked at once and none beyond the
-- batch is read. Every other subscription takes the first form, which reads
-- no message (the same statement as without these options).
-- Rows found are changed by their address (ctid), never by reading the table
-- (enable_seqscan off; docs/schema.md, "Plans that last").
CREATE OR REPLACE FUNCTION fastpubsub._lease(p_subscription_id text, p_consumers text[], p_sizes integer[])
RETURNS TABLE(slot integer, id uuid, payload jsonb, attributes jsonb, priority smallint, attempts integer,
              created_at timestamptz, receipt text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
SET enable_mergejoin = off
SET enable_hashjoin = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    v_now timestamptz := now();
    v_lease_until timestamptz;
    v_wanted integer := 0;
    v_owners text[] := '{}';  -- the consumer of each place in the batch
    v_slots integer[] := '{}';
    v_ids uuid[] := '{}';
    v_attempts integer[] := '{}';
    v_more_ids uuid[];
    v_more_attempts integer[];
    v_dead integer;
    v_first_seq bigint;
    v_priority smallint;
    v_settled bigint;
    v_left bigint := 0;
    v_expiry boolean := s.message_ttl_seconds IS NOT NULL OR s.expiring_messages;
    v_ttl_floor uuid;
    v_expired tid[];
BEGIN
    IF coalesce(cardinality(p_consumers), 0) = 0 OR cardinality(p_consumers) <> cardinality(p_sizes) THEN
        RAISE EXCEPTION 'one batch size per consumer' USING ERRCODE = 'FP422';
    END IF;
    FOR k IN 1 .. cardinality(p_consumers) LOOP
        IF p_sizes[k] IS NULL OR p_sizes[k] < 1 OR p_sizes[k] > 1000 THEN
            RAISE EXCEPTION 'batch size must be between 1 and 1000' USING ERRCODE = 'FP422';
        END IF;
        IF p_consumers[k] IS NULL OR length(p_consumers[k]) NOT BETWEEN 1 AND 200 THEN
            RAISE EXCEPTION 'consumer id must be 1 to 200 characters' USING ERRCODE = 'FP422';
        END IF;
        v_wanted := v_wanted + p_sizes[k];
        v_owners := v_owners || array_fill(p_consumers[k], ARRAY[p_sizes[k]]);
        v_slots := v_slots || array_fill(k, ARRAY[p_sizes[k]]);
    END LOOP;
    v_lease_until := v_now + make_interval(secs => s.ack_deadline_seconds);

    -- 1. (Locking the rows gives this transaction its id before nextval runs:
    --    see _advance_watermark.)
    WITH due AS MATERIALIZED (
        SELECT d.ctid AS row_id, d.attempts >= s.max_delivery_attempts AS exhausted
        FROM fastpubsub.deliveries AS d
        WHERE d.subscription_key = s.key AND d.status = 'scheduled' AND d.visible_at <= v_now
        ORDER BY d.visible_at
        LIMIT v_wanted
        FOR UPDATE SKIP LOCKED
    ), dead AS (
        UPDATE fastpubsub.deliveries AS d
        SET status = 'dlq', visible_at = v_now
        WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM due WHERE exhausted))
        RETURNING 1
    ), queued AS (
        UPDATE fastpubsub.deliveries AS d
        SET status = 'available', seq = nextval('fastpubsub.delivery_seq'), visible_at = v_now
        WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM due WHERE NOT exhausted))
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM dead), (SELECT count(*) FROM queued) INTO v_left, v_settled;
    IF v_expiry THEN
        v_ttl_floor := CASE WHEN s.message_ttl_seconds IS NOT NULL
                            THEN fastpubsub._message_id_floor(v_now - make_interval(secs => s.message_ttl_seconds))
                            ELSE '00000000-0000-0000-0000-000000000000'::uuid END;
    END IF;

    -- 2.
    v_priority := fastpubsub._next_priority(s.key, NULL);
    WHILE v_priority IS NOT NULL AND cardinality(v_ids) < v_wanted LOOP
        LOOP
            IF v_expiry THEN
                WITH ready AS MATERIALIZED (
                    SELECT d.ctid AS row_id, d.seq, d.attempts >= s.max_delivery_attempts AS exhausted,
                           d.message_id < v_ttl_floor OR coalesce(x.expires_at <= v_now, false) AS expired
                    FROM fastpubsub.deliveries AS d
                    LEFT JOIN LATERAL (
                        SELECT m.expires_at FROM fastpubsub.messages AS m
                        WHERE s.expiring_messages AND m.topic_key = s.topic_key AND m.id = d.message_id
                        LIMIT 1
                    ) AS x ON true
                    WHERE d.subscription_key = s.key AND d.status = 'available' AND d.priority = v_priority
                      AND d.seq >= s.consume_from
                      AND (d.lease_until IS NULL OR d.lease_until <= v_now)
                    ORDER BY d.seq
                    LIMIT v_wanted - cardinality(v_ids)
                    FOR UPDATE OF d SKIP LOCKED
                ), dead AS (
                    UPDATE fastpubsub.deliveries AS d
                    SET status = 'dlq', visible_at = v_now, lease_until = NULL, leased_at = NULL, consumer_id = NULL
                    WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM ready WHERE exhausted AND NOT expired))
                    RETURNING 1
                ), places AS (
                    SELECT r.row_id, cardinality(v_ids) + row_number() OVER (ORDER BY r.seq) AS place
                    FROM ready AS r WHERE NOT r.exhausted AND NOT r.expired
                ), leased AS (
                    UPDATE fastpubsub.deliveries AS d
                    SET attempts = d.attempts + 1, lease_until = v_lease_until, leased_at = v_now,
                        consumer_id = v_owners[p.place]
                    FROM places AS p
                    WHERE d.ctid = p.row_id
                    RETURNING d.seq, d.message_id, d.attempts
                )
                SELECT (SELECT count(*) FROM dead),
                       ARRAY(SELECT row_id FROM ready WHERE expired),
                       coalesce((SELECT array_agg(message_id ORDER BY seq) FROM leased), '{}'),
                       coalesce((SELECT array_agg(attempts ORDER BY seq) FROM leased), '{}'),
                       least(v_first_seq, (SELECT min(seq) FROM ready))
                INTO v_dead, v_expired, v_more_ids, v_more_attempts, v_first_seq;
                v_left := v_left + v_dead;
                v_dead := v_dead + fastpubsub._expire_rows(s, v_expired);
                v_ids := v_ids || v_more_ids;
                v_attempts := v_attempts || v_more_attempts;
                EXIT WHEN v_dead = 0 OR cardinality(v_ids) >= v_wanted;
                CONTINUE;
            END IF;
            WITH ready AS MATERIALIZED (
                SELECT d.ctid AS row_id, d.seq, d.attempts >= s.max_delivery_attempts AS exhausted
                FROM fastpubsub.deliveries AS d
                WHERE d.subscription_key = s.key AND d.status = 'available' AND d.priority = v_priority
                  AND d.seq >= s.consume_from
                  AND (d.lease_until IS NULL OR d.lease_until <= v_now)
                ORDER BY d.seq
                LIMIT v_wanted - cardinality(v_ids)
                FOR UPDATE SKIP LOCKED
            ), dead AS (
                UPDATE fastpubsub.deliveries AS d
                SET status = 'dlq', visible_at = v_now, lease_until = NULL, leased_at = NULL, consumer_id = NULL
                WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM ready WHERE exhausted))
                RETURNING 1
            ), places AS (
                -- The place in the batch each row takes, counted in queue order.
                SELECT r.row_id, cardinality(v_ids) + row_number() OVER (ORDER BY r.seq) AS place
                FROM ready AS r WHERE NOT r.exhausted
            ), leased AS (
                UPDATE fastpubsub.deliveries AS d
                SET attempts = d.attempts + 1, lease_until = v_lease_until, leased_at = v_now,
                    consumer_id = v_owners[p.place]
                FROM places AS p
                WHERE d.ctid = p.row_id
                RETURNING d.seq, d.message_id, d.attempts
            )
            SELECT (SELECT count(*) FROM dead),
                   coalesce((SELECT array_agg(message_id ORDER BY seq) FROM leased), '{}'),
                   coalesce((SELECT array_agg(attempts ORDER BY seq) FROM leased), '{}'),
                   least(v_first_seq, (SELECT min(seq) FROM ready))
            INTO v_dead, v_more_ids, v_more_attempts, v_first_seq;
            v_left := v_left + v_dead;
            v_ids := v_ids || v_more_ids;
            v_attempts := v_attempts || v_more_attempts;
            EXIT WHEN v_dead = 0 OR cardinality(v_ids) >= v_wanted;
        END LOOP;
        v_priority := fastpubsub._next_priority(s.key, v_priority);
    END LOOP;

    IF v_left > 0 AND s.max_backlog IS NOT NULL THEN
        PERFORM fastpubsub._count(s.key, -v_left, 0, 0);  -- dead letters leave the backlog
    END IF;

    IF v_first_seq - s.consume_from > 1000 OR s.consume_from_candidate IS NOT NULL THEN
        PERFORM fastpubsub._advance_watermark(s);
    END IF;

    RETURN QUERY
        SELECT v_slots[x.ord::integer], m.id, m.payload, m.attributes, m.priority, x.attempts, m.created_at,
               fastpubsub._receipt(m.id, v_now)
        FROM unnest(v_ids, v_attempts) WITH ORDINALITY AS x(message_id, attempts, ord)
        CROSS JOIN LATERAL (
            -- LIMIT keeps this a lookup per row.
            SELECT m.id, m.payload, m.attributes, m.priority, m.created_at FROM fastpubsub.messages AS m
            WHERE m.topic_key = s.topic_key AND m.id = x.message_id
            LIMIT 1
        ) AS m
        ORDER BY x.ord;
END
$$;

-- Lease up to p_batch_size messages to p_consumer_id (see _lease).
CREATE OR REPLACE FUNCTION fastpubsub.consume(p_subscription_id text, p_consumer_id text, p_batch_size integer)
RETURNS TABLE(id uuid, payload jsonb, attributes jsonb, priority smallint, attempts integer, created_at timestamptz,
              receipt text)
LANGUAGE sql
AS $$
    SELECT l.id, l.payload, l.attributes, l.priority, l.attempts, l.created_at, l.receipt
    FROM fastpubsub._lease(p_subscription_id, ARRAY[p_consumer_id], ARRAY[p_batch_size]) AS l
$$;

-- Several consumes in one transaction (group commit): request i leases up to
-- p_sizes[i] messages of p_subscriptions[i] to p_consumers[i]; one row per
-- request, in order: how many it leased, them as the API's JSON array, and,
-- when it leased fewer than it asked for (all there was), next_due as of
-- after its leases (their lease ends included). The requests for one
-- subscription share one _lease, earlier requests first. Either all are
-- committed or none is: a caller that gets an error retries the requests one
-- at a time.
CREATE OR REPLACE FUNCTION fastpubsub._consume_batch(
    p_subscriptions text[], p_consumers text[], p_sizes integer[])
RETURNS TABLE(leased integer, data text, due double precision)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    n integer := coalesce(cardinality(p_subscriptions), 0);
    v_leased integer[] := array_fill(0, ARRAY[n]);
    v_data text[] := array_fill('[]'::text, ARRAY[n]);
    v_due double precision[] := array_fill(NULL::double precision, ARRAY[n]);
    g record;
    r record;
    v_next_due double precision;
    v_member integer;
BEGIN
    FOR g IN
        SELECT x.subscription, array_agg(x.ord::integer ORDER BY x.ord) AS members,
               array_agg(x.consumer ORDER BY x.ord) AS consumers, array_agg(x.size ORDER BY x.ord) AS sizes
        FROM unnest(p_subscriptions, p_consumers, p_sizes) WITH ORDINALITY AS x(subscription, consumer, size, ord)
        GROUP BY x.subscription
        ORDER BY min(x.ord)
    LOOP
        FOR r IN
            SELECT l.slot, count(*)::integer AS leased,
                   json_agg(fastpubsub._message_json(
                       l.id, g.subscription, l.payload, l.attempts, l.created_at, l.attributes, l.priority,
                       l.receipt) ORDER BY l.ord)::text AS data
            FROM fastpubsub._lease(g.subscription, g.consumers, g.sizes) WITH ORDINALITY
                AS l(slot, id, payload, attributes, priority, attempts, created_at, receipt, ord)
            GROUP BY l.slot
        LOOP
            v_leased[g.members[r.slot]] := r.leased;
            v_data[g.members[r.slot]] := r.data;
        END LOOP;
        -- A statement of its own: next_due sees the leases just taken.
        IF EXISTS (SELECT 1 FROM unnest(g.members, g.sizes) AS m(member, size) WHERE v_leased[m.member] < m.size) THEN
            v_next_due := fastpubsub.next_due(g.subscription);
            FOR k IN 1 .. cardinality(g.members) LOOP
                v_member := g.members[k];
                IF v_leased[v_member] < g.sizes[k] THEN
                    v_due[v_member] := v_next_due;
                END IF;
            END LOOP;
        END IF;
    END LOOP;
    FOR i IN 1 .. n LOOP
        leased := v_leased[i];
        data := v_data[i];
        due := v_due[i];
        RETURN NEXT;
    END LOOP;
END
$$;

-- Seconds until a due retry, delayed message or lease end may make a message
-- deliverable: 0 when one is due already, NULL when nothing is pending at all.
-- Each priority's in-flight rows are read through an index range, never by
-- scanning the table.
CREATE OR REPLACE FUNCTION fastpubsub.next_due(p_subscription_id text)
RETURNS double precision
LANGUAGE plpgsql STABLE
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    v_at timestamptz;
    v_lease timestamptz;
    v_priority smallint;
BEGIN
    SELECT d.visible_at INTO v_at FROM fastpubsub.deliveries AS d
    WHERE d.subscription_key = s.key AND d.status = 'scheduled'
    ORDER BY d.visible_at LIMIT 1;
    v_priority := fastpubsub._next_priority(s.key, NULL);
    WHILE v_priority IS NOT NULL LOOP
        SELECT min(d.lease_until) INTO v_lease FROM fastpubsub.deliveries AS d
        WHERE d.subscription_key = s.key AND d.status = 'available' AND d.priority = v_priority
          AND d.seq >= s.consume_from;
        v_at := least(v_at, v_lease);
        v_priority := fastpubsub._next_priority(s.key, v_priority);
    END LOOP;
    IF v_at IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN greatest(extract(epoch FROM v_at - now())::double precision, 0);
END
$$;

-- next_due for a statement that has just leased (consume_events): next_due is
-- STABLE, so within the statement that leased it reads the snapshot from before
-- the leases, and misses them (the messages just leased look deliverable, or
-- their new lease ends go unseen). A VOLATILE function's query takes a
-- snapshot of its own, which sees them.
CREATE OR REPLACE FUNCTION fastpubsub._next_due_after_lease(p_subscription_id text)
RETURNS double precision
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
    RETURN fastpubsub.next_due(p_subscription_id);
END
$$;

-- A stream calls this every 30 s while it runs: acks and nacks of the
-- subscription then notify `settled:<subscription>`, so the stream can send more.
CREATE OR REPLACE FUNCTION fastpubsub.touch_stream(p_subscription_id text)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    UPDATE fastpubsub.subscriptions SET streaming_until = now() + interval '60 seconds'
    WHERE id = p_subscription_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'subscription "%" not found', p_subscription_id USING ERRCODE = 'FP404';
    END IF;
END
$$;

-- The next p_limit messages consume would deliver, in its order, leasing
-- nothing and changing nothing: per priority (highest first), the waiting
-- rows nobody holds in queue order, then the retries and delayed messages
-- whose time has come (consume puts those at the back of their priority's
-- queue). state: 'available' (waiting in the queue), 'due' (a retry or delayed
-- message that joins the queue at the next consume) or 'expired' (past its
-- TTL: consume will drop or dead-letter it, never deliver it). Rows with no
-- attempt left, which consume dead-letters, are left out. Each priority's rows
-- are one index range, so a peek reads at most p_limit rows per priority.
CREATE OR REPLACE FUNCTION fastpubsub.peek(p_subscription_id text, p_limit integer)
RETURNS TABLE(id uuid, payload jsonb, attributes jsonb, priority smallint, attempts integer, created_at timestamptz,
              state text, expires_at timestamptz)
LANGUAGE plpgsql STABLE
SET enable_bitmapscan = off
SET jit = off
AS $$
#variable_conflict use_column
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    v_now timestamptz := now();
    v_priorities smallint[] := '{}';
    v_priority smallint;
    v_ttl_floor uuid := CASE WHEN s.message_ttl_seconds IS NOT NULL
                             THEN fastpubsub._message_id_floor(now() - make_interval(secs => s.message_ttl_seconds))
                             ELSE '00000000-0000-0000-0000-000000000000'::uuid END;
BEGIN
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 1000 THEN
        RAISE EXCEPTION 'limit must be between 1 and 1000' USING ERRCODE = 'FP422';
    END IF;
    v_priority := fastpubsub._next_priority(s.key, NULL);
    WHILE v_priority IS NOT NULL LOOP
        v_priorities := v_priorities || v_priority;
        v_priority := fastpubsub._next_priority(s.key, v_priority);
    END LOOP;
    RETURN QUERY
        SELECT m.id, m.payload, m.attributes, m.priority, c.attempts, m.created_at,
               CASE WHEN c.message_id < v_ttl_floor OR m.expires_at <= v_now THEN 'expired'
                    WHEN c.due THEN 'due' ELSE 'available' END,
               least(m.expires_at, CASE WHEN s.message_ttl_seconds IS NOT NULL
                                        THEN m.created_at + make_interval(secs => s.message_ttl_seconds) END)
        FROM (
            SELECT w.* FROM (
                SELECT d.message_id, d.attempts, d.priority, false AS due, d.seq, NULL::timestamptz AS visible_at
                FROM unnest(v_priorities) AS p(priority)
                CROSS JOIN LATERAL (
                    SELECT x.message_id, x.attempts, x.priority, x.seq FROM fastpubsub.deliveries AS x
                    WHERE x.subscription_key = s.key AND x.status = 'available' AND x.priority = p.priority
                      AND x.seq >= s.consume_from AND (x.lease_until IS NULL OR x.lease_until <= v_now)
                      AND x.attempts < s.max_delivery_attempts
                    ORDER BY x.seq
                    LIMIT p_limit
                ) AS d
                UNION ALL
                SELECT d.message_id, d.attempts, d.priority, true, NULL, d.visible_at
                FROM (
                    SELECT x.message_id, x.attempts, x.priority, x.visible_at FROM fastpubsub.deliveries AS x
                    WHERE x.subscription_key = s.key AND x.status = 'scheduled' AND x.visible_at <= v_now
                      AND x.attempts < s.max_delivery_attempts
                    ORDER BY x.visible_at
                    LIMIT p_limit
                ) AS d
            ) AS w
            ORDER BY w.priority DESC, w.due, w.seq, w.visible_at
            LIMIT p_limit
        ) AS c
        CROSS JOIN LATERAL (
            SELECT m.id, m.payload, m.attributes, m.priority, m.created_at, m.expires_at FROM fastpubsub.messages AS m
            WHERE m.topic_key = s.topic_key AND m.id = c.message_id
            LIMIT 1
        ) AS m
        ORDER BY c.priority DESC, c.due, c.seq, c.visible_at;
END
$$;
