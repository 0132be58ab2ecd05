-- Correctness fixes to leasing, retries, cleanup and metrics.
--
-- * ack, nack and extend_lease act on current leases only: a lease that has
--   run out is no longer the consumer's (it may already be someone else's).
-- * A retry or delayed message that falls due joins the queue of its priority
--   instead of jumping ahead of every priority; one that has no attempt left
--   (max_delivery_attempts lowered meanwhile) goes to the DLQ.
-- * Publishing delayed messages and nacking wake waiting consumers, so that a
--   long-poll or stream learns the new due time; next_due says NULL, not 0,
--   when nothing is pending. Acks and nacks wake only streams waiting for room
--   (`settled:<subscription>`), not every long-poll.
-- * Two cleanups removing a message's last two references can no longer both
--   keep the message; idempotency keys live as long as their message.
-- * subscription_metrics reads through indexes only; cleanup_stuck never
--   cuts a live lease short.
-- * $match runs in time proportional to words x pattern, not exponential.
-- * The first revision's publish goes through publish_v2.
-- Signatures are unchanged, so running servers keep working; cleanup_stuck_v2
-- also says how many leases it released and how many it dead-lettered.

-- ---------------------------------------------------------------------------
-- Leases: only current ones count
-- ---------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION fastpubsub._held(p_subscription_key integer, p_ids uuid[])
RETURNS tid[]
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (
        SELECT coalesce(array_agg(h.row_id), '{}')
        FROM unnest(p_ids) AS x(id)
        CROSS JOIN LATERAL (
            SELECT d.ctid AS row_id FROM fastpubsub.deliveries AS d
            WHERE d.subscription_key = p_subscription_key AND d.message_id = x.id AND d.lease_until > now()
            LIMIT 1
        ) AS h);
END
$$;

CREATE OR REPLACE FUNCTION fastpubsub.ack(p_subscription_id text, p_ids uuid[])
RETURNS integer
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    n integer;
BEGIN
    WITH gone AS (
        DELETE FROM fastpubsub.deliveries AS d
        WHERE d.ctid = ANY (fastpubsub._held(s.key, p_ids)) AND d.lease_until > now()
        RETURNING d.message_id, d.attempts
    )
    INSERT INTO fastpubsub.acked_deliveries (acked_at, message_id, subscription_key, attempts)
    SELECT now(), gone.message_id, s.key, gone.attempts FROM gone;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 AND s.streaming_until > now() THEN
        PERFORM fastpubsub._notify(ARRAY['settled:' || s.id]);
    END IF;
    RETURN n;
END
$$;

-- A nack wakes the subscription's waiting consumers whenever a message goes
-- back into the queue, now or later: they read the next due time again.
-- While a stream is registered (touch_stream), acks and nacks also notify
-- `settled:<subscription>`, which wakes only streams waiting for room (the
-- plain subscription name would wake every long-poll for nothing).
CREATE OR REPLACE FUNCTION fastpubsub.nack(
    p_subscription_id text, p_ids uuid[], OUT nacked integer, OUT dead_lettered integer)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
BEGIN
    WITH changed AS (
        UPDATE fastpubsub.deliveries AS d
        SET status = CASE WHEN d.attempts >= s.max_delivery_attempts
                          THEN 'dlq' ELSE 'scheduled' END::fastpubsub.delivery_status,
            visible_at = CASE WHEN d.attempts >= s.max_delivery_attempts THEN now()
                              ELSE now() + make_interval(secs => least(
                                  s.backoff_max_seconds::double precision,
                                  s.backoff_min_seconds * power(2::double precision, greatest(d.attempts, 1) - 1)))
                         END,
            lease_until = NULL,
            leased_at = NULL,
            consumer_id = NULL
        WHERE d.ctid = ANY (fastpubsub._held(s.key, p_ids)) AND d.lease_until > now()
        RETURNING d.status
    )
    SELECT count(*), count(*) FILTER (WHERE status = 'dlq') INTO nacked, dead_lettered FROM changed;
    IF nacked > 0 THEN
        PERFORM fastpubsub._notify(array_remove(ARRAY[
            CASE WHEN nacked > dead_lettered THEN s.id END,
            CASE WHEN s.streaming_until > now() THEN 'settled:' || s.id END], NULL));
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION fastpubsub.extend_lease(p_subscription_id text, p_ids uuid[], p_seconds integer)
RETURNS integer
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    n integer;
BEGIN
    IF p_seconds IS NULL OR p_seconds < 0 OR p_seconds > 3600 THEN
        RAISE EXCEPTION 'lease seconds must be between 0 and 3600' USING ERRCODE = 'FP422';
    END IF;
    UPDATE fastpubsub.deliveries AS d
    SET lease_until = now() + make_interval(secs => p_seconds)
    WHERE d.ctid = ANY (fastpubsub._held(s.key, p_ids)) AND d.lease_until > now();
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- Deliveries that are not leased now and have no attempt left belong in the
-- DLQ (consume moves them as it meets them; this does it for a whole
-- subscription before the DLQ is read).
CREATE OR REPLACE FUNCTION fastpubsub._settle_exhausted(s fastpubsub.subscriptions)
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    n integer;
BEGIN
    UPDATE fastpubsub.deliveries AS d
    SET status = 'dlq', visible_at = now(), lease_until = NULL, leased_at = NULL, consumer_id = NULL
    WHERE d.ctid = ANY (ARRAY(
        SELECT x.ctid FROM fastpubsub.deliveries AS x
        WHERE x.subscription_key = s.key AND x.status = 'available'
          AND (x.lease_until IS NULL OR x.lease_until <= now()) AND x.attempts >= s.max_delivery_attempts
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- ---------------------------------------------------------------------------
-- Consume: due retries and delayed messages keep their priority
-- ---------------------------------------------------------------------------

-- 1. Scheduled rows whose time has come join the back of their priority's
--    queue (a new seq), or go to the DLQ when no attempt is left.
-- 2. The highest priority first; within one, queue order among rows nobody
--    holds, including leases that ran out (a failed attempt; dead-lettered when
--    none is left, which does not fill the batch).
CREATE OR REPLACE FUNCTION fastpubsub.consume_v2(p_subscription_id text, p_consumer_id text, p_batch_size integer)
RETURNS TABLE (id uuid, payload jsonb, attributes jsonb, priority smallint, attempts integer,
               created_at timestamptz)
LANGUAGE plpgsql
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
    v_priority smallint;
    v_settled bigint;
BEGIN
    IF p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 1000 THEN
        RAISE EXCEPTION 'batch size must be between 1 and 1000' USING ERRCODE = 'FP422';
    END IF;
    IF p_consumer_id IS NULL OR length(p_consumer_id) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'consumer id must be 1 to 200 characters' USING ERRCODE = 'FP422';
    END IF;
    v_lease_until := v_now + make_interval(secs => s.ack_deadline_seconds);

    -- 1. (Locking the rows gives this transaction its id before nextval runs:
    --    see _advance_watermark.)
    WITH due AS MATERIALIZED (
        SELECT d.ctid AS row_id, d.attempts >= s.max_delivery_attempts AS exhausted
        FROM fastpubsub.deliveries AS d
        WHERE d.subscription_key = s.key AND d.status = 'scheduled' AND d.visible_at <= v_now
        ORDER BY d.visible_at
        LIMIT p_batch_size
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
    SELECT (SELECT count(*) FROM dead) + (SELECT count(*) FROM queued) INTO v_settled;

    -- 2.
    v_priority := fastpubsub._next_priority(s.key, NULL);
    WHILE v_priority IS NOT NULL AND cardinality(v_ids) < p_batch_size LOOP
        LOOP
            WITH ready AS MATERIALIZED (
                SELECT d.ctid AS row_id, d.seq, d.attempts >= s.max_delivery_attempts AS exhausted
                FROM fastpubsub.deliveries AS d
                WHERE d.subscription_key = s.key AND d.status = 'available' AND d.priority = v_priority
                  AND d.seq >= s.consume_from
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
            EXIT WHEN v_dead = 0 OR cardinality(v_ids) >= p_batch_size;
        END LOOP;
        v_priority := fastpubsub._next_priority(s.key, v_priority);
    END LOOP;

    IF v_first_seq - s.consume_from > 1000 OR s.consume_from_candidate IS NOT NULL THEN
        PERFORM fastpubsub._advance_watermark_v2(s);
    END IF;

    RETURN QUERY
        SELECT m.id, m.payload, m.attributes, m.priority, x.attempts, m.created_at
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

-- Seconds until a due retry, delayed message or lease end may make a message
-- deliverable: 0 when one is due already, NULL when nothing is pending at all
-- (0 then made idle long-polls look again at once).
CREATE OR REPLACE FUNCTION fastpubsub.next_due(p_subscription_id text)
RETURNS double precision
LANGUAGE plpgsql STABLE
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
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

-- ---------------------------------------------------------------------------
-- Publish
-- ---------------------------------------------------------------------------

-- Same as before, except: a priority such as 1.0 is the integer it stands
-- for, and subscriptions fed a delayed message are notified too.
CREATE OR REPLACE FUNCTION fastpubsub.publish_v2(p_topic_id text, p_messages jsonb, p_envelopes boolean)
RETURNS uuid[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_topic_key integer;
    v_now timestamptz := now();
    v_problem text;
    v_ids uuid[];
    v_keys text[];
    v_store boolean[];
    v_final uuid[];
    v_woken text[];
BEGIN
    SELECT key INTO v_topic_key FROM fastpubsub.topics WHERE id = p_topic_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'topic "%" not found', p_topic_id USING ERRCODE = 'FP404';
    END IF;
    IF p_messages IS NULL OR jsonb_typeof(p_messages) <> 'array' OR jsonb_array_length(p_messages) = 0 THEN
        RAISE EXCEPTION 'messages must be a non-empty JSON array' USING ERRCODE = 'FP422';
    END IF;
    IF p_envelopes THEN
        SELECT fastpubsub._envelope_problem(e.value, e.ord - 1) INTO v_problem
        FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS e(value, ord)
        WHERE fastpubsub._envelope_problem(e.value, e.ord - 1) IS NOT NULL
        ORDER BY e.ord LIMIT 1;
    ELSE
        SELECT format('message at index %s is not a JSON object; nothing was published', e.ord - 1) INTO v_problem
        FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS e(value, ord)
        WHERE jsonb_typeof(e.value) <> 'object'
        ORDER BY e.ord LIMIT 1;
    END IF;
    IF v_problem IS NOT NULL THEN
        RAISE EXCEPTION '%', v_problem USING ERRCODE = 'FP422';
    END IF;

    PERFORM fastpubsub._lock_topic(v_topic_key, false);
    PERFORM pg_current_xact_id();  -- before drawing queue numbers (see _advance_watermark)

    SELECT array_agg(fastpubsub._message_id(v_now, e.ord - 1) ORDER BY e.ord),
           array_agg(CASE WHEN p_envelopes THEN e.value ->> 'idempotency_key' END ORDER BY e.ord)
    INTO v_ids, v_keys
    FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS e(value, ord);
    v_final := v_ids;
    v_store := array_fill(true, ARRAY[cardinality(v_ids)]);

    IF EXISTS (SELECT 1 FROM unnest(v_keys) AS k WHERE k IS NOT NULL) THEN
        -- Claim the keys: the first message with a key this topic has not seen is stored.
        -- (A concurrent publish with the same key makes this wait for it, then skip.)
        WITH claimed AS (
            INSERT INTO fastpubsub.idempotency_keys (topic_key, key, message_id, created_at)
            SELECT DISTINCT ON (x.key) v_topic_key, x.key, x.id, v_now
            FROM unnest(v_keys, v_ids) WITH ORDINALITY AS x(key, id, ord)
            WHERE x.key IS NOT NULL
            ORDER BY x.key, x.ord
            ON CONFLICT DO NOTHING
            RETURNING message_id
        )
        SELECT array_agg(x.id = ANY (ARRAY(SELECT message_id FROM claimed)) OR x.key IS NULL ORDER BY x.ord)
        INTO v_store
        FROM unnest(v_keys, v_ids) WITH ORDINALITY AS x(key, id, ord);
        -- Every keyed message takes the id its key stands for (a new statement,
        -- so keys committed by a concurrent publish are visible).
        SELECT array_agg(coalesce(k.message_id, x.id) ORDER BY x.ord)
        INTO v_final
        FROM unnest(v_keys, v_ids) WITH ORDINALITY AS x(key, id, ord)
        LEFT JOIN fastpubsub.idempotency_keys AS k ON k.topic_key = v_topic_key AND k.key = x.key;
    END IF;

    WITH input AS MATERIALIZED (
        SELECT x.id,
               x.ord,
               CASE WHEN p_envelopes THEN e.value -> 'payload' ELSE e.value END AS payload,
               CASE WHEN p_envelopes THEN nullif(nullif(e.value -> 'attributes', 'null'::jsonb), '{}'::jsonb) END
                   AS attributes,
               CASE WHEN NOT p_envelopes THEN v_now
                    WHEN jsonb_typeof(e.value -> 'deliver_at') = 'string' THEN (e.value ->> 'deliver_at')::timestamptz
                    WHEN jsonb_typeof(e.value -> 'delay_seconds') = 'number'
                        THEN v_now + make_interval(secs => (e.value ->> 'delay_seconds')::double precision)
                    ELSE v_now END AS visible_at,
               CASE WHEN p_envelopes AND jsonb_typeof(e.value -> 'priority') = 'number'
                    THEN (e.value ->> 'priority')::numeric::smallint ELSE 0::smallint END AS priority
        FROM unnest(v_ids, v_store) WITH ORDINALITY AS x(id, store, ord)
        JOIN jsonb_array_elements(p_messages) WITH ORDINALITY AS e(value, ord) ON e.ord = x.ord
        WHERE x.store
    ), routes AS MATERIALIZED (
        SELECT i.id, i.visible_at, i.priority, s.key AS subscription_key, s.id AS subscription_id
        FROM input AS i
        JOIN fastpubsub.subscriptions AS s
          ON s.topic_key = v_topic_key
         AND (s.filter IS NULL
              OR CASE WHEN s.filter_simple THEN fastpubsub._filter_matches_seed(s.filter, i.payload)
                      ELSE fastpubsub._filter_eval(s.filter, i.payload, i.attributes) END)
    ), stored AS (
        INSERT INTO fastpubsub.messages (created_at, id, topic_key, fanout, payload, attributes, priority)
        SELECT v_now, i.id, v_topic_key, count(r.id), i.payload, i.attributes, i.priority
        FROM input AS i LEFT JOIN routes AS r ON r.id = i.id
        GROUP BY i.ord, i.id, i.payload, i.attributes, i.priority
    ), fanned AS (
        -- Grouped by subscription so that one consume batch touches few pages.
        INSERT INTO fastpubsub.deliveries (visible_at, seq, message_id, subscription_key, status, priority)
        SELECT r.visible_at, nextval('fastpubsub.delivery_seq'), r.id, r.subscription_key,
               CASE WHEN r.visible_at > v_now THEN 'scheduled' ELSE 'available' END::fastpubsub.delivery_status,
               r.priority
        FROM (SELECT * FROM routes ORDER BY subscription_key, id) AS r
    )
    SELECT array_agg(DISTINCT r.subscription_id) INTO v_woken FROM routes AS r;

    PERFORM fastpubsub._notify(v_woken);
    RETURN v_final;
END
$$;

-- The first revision's publish: the same work as publish_v2 with plain payloads.
CREATE OR REPLACE FUNCTION fastpubsub.publish(p_topic_id text, p_payloads jsonb)
RETURNS uuid[]
LANGUAGE sql
AS $$
    SELECT fastpubsub.publish_v2(p_topic_id, p_payloads, false)
$$;

-- ---------------------------------------------------------------------------
-- Filters
-- ---------------------------------------------------------------------------

-- AMQP-style topic match on dot-separated words: `*` is exactly one word, `#`
-- zero or more. One pass that backs up only to the last `#` seen: at most
-- words x pattern steps, however many `#` the pattern holds.
CREATE OR REPLACE FUNCTION fastpubsub._amqp_match(p_words text[], p_pattern text[])
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    n integer := coalesce(cardinality(p_words), 0);
    m integer := coalesce(cardinality(p_pattern), 0);
    i integer := 1;       -- next word to match
    j integer := 1;       -- next pattern word
    hash_j integer := 0;  -- the last `#` met (0: none yet)
    hash_i integer := 0;  -- the words before hash_i are matched up to that `#`
BEGIN
    WHILE i <= n LOOP
        IF j <= m AND p_pattern[j] = '#' THEN
            hash_j := j;     -- let `#` take no word first
            hash_i := i;
            j := j + 1;
        ELSIF j <= m AND (p_pattern[j] = '*' OR p_pattern[j] = p_words[i]) THEN
            i := i + 1;
            j := j + 1;
        ELSIF hash_j > 0 THEN
            hash_i := hash_i + 1;  -- no: the last `#` takes one more word
            i := hash_i;
            j := hash_j + 1;
        ELSE
            RETURN false;
        END IF;
    END LOOP;
    WHILE j <= m AND p_pattern[j] = '#' LOOP
        j := j + 1;
    END LOOP;
    RETURN j > m;
END
$$;

-- ---------------------------------------------------------------------------
-- Deleting and cleaning up
-- ---------------------------------------------------------------------------

CREATE OR REPLACE FUNCTION fastpubsub.delete_topic(p_id text)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_topic_key integer;
    v_subscription_keys integer[];
BEGIN
    SELECT key INTO v_topic_key FROM fastpubsub.topics WHERE id = p_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'topic "%" not found', p_id USING ERRCODE = 'FP404';
    END IF;
    PERFORM fastpubsub._lock_topic(v_topic_key, true);
    SELECT coalesce(array_agg(key), '{}') INTO v_subscription_keys
    FROM fastpubsub.subscriptions WHERE topic_key = v_topic_key;
    -- Every delete below walks a primary key prefix: no table scans.
    DELETE FROM fastpubsub.deliveries WHERE subscription_key = ANY (v_subscription_keys);
    DELETE FROM fastpubsub.acked_deliveries WHERE subscription_key = ANY (v_subscription_keys);
    DELETE FROM fastpubsub.messages WHERE topic_key = v_topic_key;
    DELETE FROM fastpubsub.idempotency_keys WHERE topic_key = v_topic_key;
    DELETE FROM fastpubsub.topics WHERE key = v_topic_key;  -- cascades to subscriptions
END
$$;

-- Delete messages (of the given ids) that no delivery references any more.
CREATE OR REPLACE FUNCTION fastpubsub._delete_orphan_messages(p_topic_keys integer[], p_message_ids uuid[])
RETURNS integer
LANGUAGE plpgsql
-- Lookups per candidate: never a merge or hash join over a topic's history.
SET enable_mergejoin = off
SET enable_hashjoin = off
AS $$
DECLARE
    n integer;
BEGIN
    -- Two cleanups that each delete one of a message's last two references
    -- would each still see the other's and both keep the message, for good.
    -- So the candidates are locked first, always in the same order (no
    -- deadlock between cleanups), and the references are checked by the next
    -- statement: under READ COMMITTED it sees whatever the cleanup that held a
    -- lock before us committed.
    PERFORM 1
    FROM fastpubsub.messages AS m
    JOIN (SELECT DISTINCT c.topic_key, c.message_id
          FROM unnest(p_topic_keys, p_message_ids) AS c(topic_key, message_id)) AS c
      ON m.topic_key = c.topic_key AND m.id = c.message_id
    ORDER BY m.topic_key, m.id
    FOR UPDATE OF m;

    DELETE FROM fastpubsub.messages m
    USING (SELECT DISTINCT c.topic_key, c.message_id
           FROM unnest(p_topic_keys, p_message_ids) AS c(topic_key, message_id)) AS c
    WHERE m.topic_key = c.topic_key
      AND m.id = c.message_id
      AND NOT EXISTS (
          SELECT 1 FROM fastpubsub.subscriptions s
          JOIN fastpubsub.deliveries d ON d.subscription_key = s.key AND d.message_id = c.message_id
          WHERE s.topic_key = c.topic_key)
      AND NOT EXISTS (
          SELECT 1 FROM fastpubsub.subscriptions s
          JOIN fastpubsub.acked_deliveries a ON a.subscription_key = s.key AND a.message_id = c.message_id
          WHERE s.topic_key = c.topic_key);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- An idempotency key stands for its message while the message is retained:
-- keys older than the window whose message is gone are deleted.
CREATE OR REPLACE FUNCTION fastpubsub.cleanup_idempotency_keys(p_older_than_seconds integer, p_batch_size integer)
RETURNS integer
LANGUAGE plpgsql
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    n integer;
BEGIN
    IF p_older_than_seconds IS NULL OR p_older_than_seconds < 0
       OR p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 1000000 THEN
        RAISE EXCEPTION 'older than must be >= 0 and batch size between 1 and 1000000' USING ERRCODE = 'FP422';
    END IF;
    DELETE FROM fastpubsub.idempotency_keys AS k
    WHERE k.ctid = ANY (ARRAY(
        SELECT x.ctid FROM fastpubsub.idempotency_keys AS x
        WHERE x.created_at < now() - make_interval(secs => p_older_than_seconds)
          AND NOT EXISTS (SELECT 1 FROM fastpubsub.messages AS m
                          WHERE m.topic_key = x.topic_key AND m.id = x.message_id)
        LIMIT p_batch_size
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- End leases that were taken more than p_lock_timeout_seconds ago and have run
-- out: the message is deliverable again (released), or dead-lettered when no
-- attempt is left -- what the next consume would do on meeting it. A lease
-- still within its deadline, extended or not, is never cut short: the consumer
-- holding it is still entitled to ack. A lease taken at leased_at belongs to a
-- message published before it, so only that older part of each backlog is read.
CREATE FUNCTION fastpubsub.cleanup_stuck_v2(
    p_lock_timeout_seconds integer, OUT released integer, OUT dead_lettered integer)
LANGUAGE plpgsql
AS $$
DECLARE
    v_cutoff timestamptz;
BEGIN
    IF p_lock_timeout_seconds IS NULL OR p_lock_timeout_seconds < 0 THEN
        RAISE EXCEPTION 'lock timeout must be >= 0 seconds' USING ERRCODE = 'FP422';
    END IF;
    v_cutoff := now() - make_interval(secs => p_lock_timeout_seconds);
    WITH stuck AS MATERIALIZED (
        SELECT d.row_id, d.attempts >= s.max_delivery_attempts AS exhausted
        FROM fastpubsub.subscriptions AS s
        CROSS JOIN LATERAL (
            SELECT x.ctid AS row_id, x.attempts
            FROM fastpubsub.deliveries AS x
            WHERE x.subscription_key = s.key
              AND x.message_id < fastpubsub._message_id_floor(v_cutoff)
              AND x.lease_until <= now() AND x.leased_at < v_cutoff
            FOR UPDATE SKIP LOCKED
        ) AS d
    ), freed AS (
        UPDATE fastpubsub.deliveries AS d
        SET lease_until = NULL, leased_at = NULL, consumer_id = NULL
        WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM stuck WHERE NOT exhausted))
        RETURNING 1
    ), dead AS (
        UPDATE fastpubsub.deliveries AS d
        SET status = 'dlq', visible_at = now(), lease_until = NULL, leased_at = NULL, consumer_id = NULL
        WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM stuck WHERE exhausted))
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM freed), (SELECT count(*) FROM dead) INTO released, dead_lettered;
END
$$;

-- The first revision's cleanup_stuck: the same work, one total.
CREATE OR REPLACE FUNCTION fastpubsub.cleanup_stuck(p_lock_timeout_seconds integer)
RETURNS integer
LANGUAGE sql
AS $$
    SELECT c.released + c.dead_lettered FROM fastpubsub.cleanup_stuck_v2(p_lock_timeout_seconds) AS c
$$;

-- ---------------------------------------------------------------------------
-- Metrics through indexes
-- ---------------------------------------------------------------------------

-- Counts for one subscription:
--   available  deliverable now (including due retries and leases that ran out)
--   delivered  leased and within their deadline (in flight)
--   delayed    not deliverable yet: retry backoff or a delayed publish
--   acked      acked and not cleaned up yet
--   dlq        dead-lettered (including rows with no attempt left that are not leased now)
--   oldest_available_age_seconds  age of the oldest deliverable message (consumer lag)
-- Every count reads one partial index range of this subscription; the oldest
-- deliverable message is the oldest of each priority's queue head and of the
-- due scheduled rows.
CREATE OR REPLACE FUNCTION fastpubsub.subscription_metrics(
    p_subscription_id text,
    OUT available bigint, OUT delivered bigint, OUT delayed bigint, OUT acked bigint, OUT dlq bigint,
    OUT oldest_available_age_seconds double precision)
LANGUAGE plpgsql STABLE
SET enable_sort = off
SET enable_seqscan = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    v_now timestamptz := now();
    v_due bigint;
    v_exhausted bigint;
    v_oldest uuid;
    v_head uuid;
    v_priority smallint;
BEGIN
    SELECT count(*) FILTER (WHERE (d.lease_until IS NULL OR d.lease_until <= v_now)
                              AND d.attempts < s.max_delivery_attempts),
           count(*) FILTER (WHERE d.lease_until > v_now),
           count(*) FILTER (WHERE (d.lease_until IS NULL OR d.lease_until <= v_now)
                              AND d.attempts >= s.max_delivery_attempts)
    INTO available, delivered, v_exhausted
    FROM fastpubsub.deliveries AS d WHERE d.subscription_key = s.key AND d.status = 'available';

    v_priority := fastpubsub._next_priority(s.key, NULL);
    WHILE v_priority IS NOT NULL LOOP
        SELECT d.message_id INTO v_head
        FROM fastpubsub.deliveries AS d
        WHERE d.subscription_key = s.key AND d.status = 'available' AND d.priority = v_priority
          AND d.seq >= s.consume_from
          AND (d.lease_until IS NULL OR d.lease_until <= v_now) AND d.attempts < s.max_delivery_attempts
        ORDER BY d.seq LIMIT 1;
        IF v_head IS NOT NULL AND (v_oldest IS NULL OR v_head < v_oldest) THEN
            v_oldest := v_head;
        END IF;
        v_priority := fastpubsub._next_priority(s.key, v_priority);
    END LOOP;

    -- (uuid has no min() before PostgreSQL 18; its text form sorts the same way.)
    SELECT count(*) FILTER (WHERE d.visible_at <= v_now),
           count(*) FILTER (WHERE d.visible_at > v_now),
           min(d.message_id::text) FILTER (WHERE d.visible_at <= v_now)::uuid
    INTO v_due, delayed, v_head
    FROM fastpubsub.deliveries AS d WHERE d.subscription_key = s.key AND d.status = 'scheduled';
    IF v_head IS NOT NULL AND (v_oldest IS NULL OR v_head < v_oldest) THEN
        v_oldest := v_head;
    END IF;

    SELECT count(*) INTO dlq
    FROM fastpubsub.deliveries AS d WHERE d.subscription_key = s.key AND d.status = 'dlq';

    SELECT count(*) INTO acked FROM fastpubsub.acked_deliveries AS a WHERE a.subscription_key = s.key;

    available := available + v_due;
    dlq := dlq + v_exhausted;
    oldest_available_age_seconds := coalesce(
        (SELECT greatest(extract(epoch FROM v_now - m.created_at)::double precision, 0)
         FROM fastpubsub.messages AS m WHERE m.topic_key = s.topic_key AND m.id = v_oldest),
        0);
END
$$;
