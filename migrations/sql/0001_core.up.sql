-- fastpubsub core: tables, indexes and the broker functions.
--
-- Everything lives in the `fastpubsub` schema. Public functions form a small
-- vocabulary (publish, consume, ack, nack, extend_lease, list_dlq, reprocess_dlq,
-- cleanup_acked, cleanup_stuck, subscription_metrics, plus topic and subscription
-- administration); helpers start with an underscore. Errors use our own SQLSTATEs
-- so callers can tell them apart without parsing messages:
--   FP404 not found, FP422 invalid input.
-- docs/schema.md explains the layout.

CREATE TYPE fastpubsub.delivery_status AS ENUM ('available', 'scheduled', 'dlq');

CREATE TABLE fastpubsub.topics (
    id text PRIMARY KEY
        CONSTRAINT topics_id_format CHECK (id ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$'),
    key integer GENERATED ALWAYS AS IDENTITY UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE fastpubsub.subscriptions (
    id text PRIMARY KEY
        CONSTRAINT subscriptions_id_format CHECK (id ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$'),
    key integer GENERATED ALWAYS AS IDENTITY UNIQUE,
    topic_key integer NOT NULL REFERENCES fastpubsub.topics (key) ON DELETE CASCADE,
    filter jsonb,
    max_delivery_attempts integer NOT NULL DEFAULT 5
        CONSTRAINT subscriptions_max_delivery_attempts_range CHECK (max_delivery_attempts BETWEEN 1 AND 1000),
    backoff_min_seconds integer NOT NULL DEFAULT 5
        CONSTRAINT subscriptions_backoff_min_seconds_range CHECK (backoff_min_seconds BETWEEN 0 AND 86400),
    backoff_max_seconds integer NOT NULL DEFAULT 300
        CONSTRAINT subscriptions_backoff_max_seconds_range CHECK (backoff_max_seconds BETWEEN 0 AND 86400),
    ack_deadline_seconds integer NOT NULL DEFAULT 30
        CONSTRAINT subscriptions_ack_deadline_seconds_range CHECK (ack_deadline_seconds BETWEEN 1 AND 3600),
    -- Consume watermark (see _advance_watermark): no live available delivery of
    -- this subscription has seq < consume_from, so consume seeks straight past
    -- the index entries that acked rows leave behind until VACUUM removes them.
    consume_from bigint NOT NULL DEFAULT 0,
    consume_from_candidate bigint,
    consume_from_candidate_xmax xid8,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT subscriptions_backoff_order CHECK (backoff_max_seconds >= backoff_min_seconds)
);
CREATE INDEX subscriptions_topic_key_idx ON fastpubsub.subscriptions (topic_key);

CREATE TABLE fastpubsub.clients (
    id uuid PRIMARY KEY,
    name text NOT NULL CONSTRAINT clients_name_length CHECK (length(name) BETWEEN 1 AND 200),
    scopes text NOT NULL,
    is_active boolean NOT NULL DEFAULT true,
    secret_hash text NOT NULL,
    token_version integer NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Each published payload is stored once, whatever the number of subscriptions.
-- No foreign keys on the hot tables: a foreign key check locks the referenced
-- row for every insert, which makes concurrent publishers queue on the topic.
-- Topic and subscription deletion clean up explicitly instead.
CREATE TABLE fastpubsub.messages (
    created_at timestamptz NOT NULL,
    id uuid NOT NULL,
    topic_key integer NOT NULL,
    -- how many subscriptions the message was routed to when it was published
    fanout integer NOT NULL,
    payload jsonb NOT NULL,
    PRIMARY KEY (topic_key, id)
);
-- Reports and retention read messages by time; BRIN costs almost nothing to keep.
CREATE INDEX messages_created_at_brin ON fastpubsub.messages USING brin (created_at);
-- Messages no subscription wanted are kept for the retention window only.
CREATE INDEX messages_unrouted_idx ON fastpubsub.messages (created_at) WHERE fanout = 0;

-- Every entry into the available state draws a new number: the queue order.
-- CACHE 1 (the default) keeps numbers increasing in the order they are drawn,
-- which the consume watermark relies on.
CREATE SEQUENCE fastpubsub.delivery_seq AS bigint CACHE 1;

-- One small row per (subscription, message) until the message is acked.
--   available  deliverable, unless a consumer holds a lease on it (lease_until
--              in the future); a lease that ran out makes it deliverable again
--   scheduled  deliverable from visible_at (retry backoff)
--   dlq        dead-lettered
-- Taking and extending a lease only writes the lease columns, which no index
-- covers, so PostgreSQL updates the row in place (a HOT update: no index
-- writes). The low fillfactor leaves room on each page for that new version.
-- Columns that never change come first so that update records stay small.
CREATE TABLE fastpubsub.deliveries (
    visible_at timestamptz NOT NULL,
    seq bigint NOT NULL,
    message_id uuid NOT NULL,
    subscription_key integer NOT NULL,
    status fastpubsub.delivery_status NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    lease_until timestamptz,
    leased_at timestamptz,
    consumer_id text,
    PRIMARY KEY (subscription_key, message_id),
    -- Only available rows carry a lease, so "leased" is simply lease_until IS
    -- NOT NULL: ack, nack and extend_lease test that and reach rows through the
    -- primary key, whatever the planner believes about the partial indexes.
    CONSTRAINT deliveries_lease_only_when_available CHECK (lease_until IS NULL OR status = 'available')
) WITH (
    fillfactor = 40,
    -- acks delete rows all the time: vacuum early and often
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05
);
-- Partial indexes: consume reads only rows it may deliver, an index seek that
-- costs O(batch + leases held) however long the backlog.
CREATE INDEX deliveries_available_idx ON fastpubsub.deliveries (subscription_key, seq)
    WHERE status = 'available';
CREATE INDEX deliveries_scheduled_idx ON fastpubsub.deliveries (subscription_key, visible_at)
    WHERE status = 'scheduled';
CREATE INDEX deliveries_dlq_idx ON fastpubsub.deliveries (subscription_key, message_id)
    WHERE status = 'dlq';

-- Acked deliveries leave the hot table and wait here for cleanup_acked: history
-- for reporting and replay that never slows consume down.
CREATE TABLE fastpubsub.acked_deliveries (
    acked_at timestamptz NOT NULL,
    message_id uuid NOT NULL,
    subscription_key integer NOT NULL,
    attempts integer NOT NULL,
    PRIMARY KEY (subscription_key, message_id)
);
CREATE INDEX acked_deliveries_acked_at_brin ON fastpubsub.acked_deliveries USING brin (acked_at);

-- ---------------------------------------------------------------------------
-- Helpers
-- ---------------------------------------------------------------------------

-- Time-ordered message ids in the UUIDv7 layout: 48 bits of Unix milliseconds,
-- 12 bits of sub-millisecond time (1/4096 ms), 62 random bits. `p_offset` adds
-- that many 1/4096 ms steps so that messages of one publish keep their order.
CREATE FUNCTION fastpubsub._message_id(p_time timestamptz, p_offset bigint)
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

-- The smallest message id that can belong to a message published at p_time.
CREATE FUNCTION fastpubsub._message_id_floor(p_time timestamptz)
RETURNS uuid
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT encode(
        substring(int8send(t.units >> 12) FROM 3 FOR 6)
        || substring(int4send(((t.units & 4095) | 28672)::integer) FROM 3 FOR 2)
        || '\x0000000000000000'::bytea,
        'hex')::uuid
    FROM (SELECT floor(extract(epoch FROM p_time) * 4096000)::bigint AS units) AS t
$$;

-- Seed filter semantics: {"key": [allowed values]}. Every key must be present in
-- the payload with a value equal (as JSON) to one of its allowed values.
CREATE FUNCTION fastpubsub._filter_matches(p_filter jsonb, p_payload jsonb)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT p_filter IS NULL OR NOT EXISTS (
        SELECT 1
        FROM jsonb_each(p_filter) AS f(key, allowed)
        WHERE NOT EXISTS (
            SELECT 1 FROM jsonb_array_elements(f.allowed) AS a(value)
            WHERE a.value = p_payload -> f.key
        )
    )
$$;

-- Raises FP422 naming the offending key when p_filter is not a valid filter;
-- returns the filter to store ({} is stored as NULL: no filtering).
CREATE FUNCTION fastpubsub._validate_filter(p_filter jsonb)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    f record;
BEGIN
    IF p_filter IS NULL OR p_filter = 'null'::jsonb OR p_filter = '{}'::jsonb THEN
        RETURN NULL;
    END IF;
    IF jsonb_typeof(p_filter) <> 'object' THEN
        RAISE EXCEPTION 'filter must be a JSON object' USING ERRCODE = 'FP422';
    END IF;
    IF octet_length(p_filter::text) > 16384 THEN
        RAISE EXCEPTION 'filter is larger than 16384 bytes' USING ERRCODE = 'FP422';
    END IF;
    FOR f IN SELECT key, value FROM jsonb_each(p_filter) LOOP
        IF f.key = '' THEN
            RAISE EXCEPTION 'filter keys must not be empty' USING ERRCODE = 'FP422';
        END IF;
        IF jsonb_typeof(f.value) <> 'array' OR jsonb_array_length(f.value) = 0 THEN
            RAISE EXCEPTION 'filter key "%" must map to a non-empty array of allowed values', f.key
                USING ERRCODE = 'FP422';
        END IF;
    END LOOP;
    RETURN p_filter;
END
$$;

CREATE FUNCTION fastpubsub._subscription(p_subscription_id text)
RETURNS fastpubsub.subscriptions
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    s fastpubsub.subscriptions;
BEGIN
    SELECT * INTO s FROM fastpubsub.subscriptions WHERE id = p_subscription_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'subscription "%" not found', p_subscription_id USING ERRCODE = 'FP404';
    END IF;
    RETURN s;
END
$$;

-- Publishers take this lock shared and topic or subscription changes take it
-- exclusive, so a publish never fans out to a subscription being deleted.
CREATE FUNCTION fastpubsub._lock_topic(p_topic_key integer, p_exclusive boolean)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    -- 1718645602 is 'fpsb': our own advisory lock namespace.
    IF p_exclusive THEN
        PERFORM pg_advisory_xact_lock(1718645602, p_topic_key);
    ELSE
        PERFORM pg_advisory_xact_lock_shared(1718645602, p_topic_key);
    END IF;
END
$$;

-- Wake long-poll and streaming consumers of these subscriptions.
CREATE FUNCTION fastpubsub._notify(p_subscription_ids text[])
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_payload text := array_to_string(p_subscription_ids, ' ');
BEGIN
    IF v_payload IS NULL OR v_payload = '' THEN
        RETURN;
    END IF;
    IF octet_length(v_payload) > 7000 THEN
        v_payload := '*';  -- too many to list: wake everyone
    END IF;
    PERFORM pg_notify('fastpubsub', v_payload);
END
$$;

-- Where the leased deliveries of these message ids are: one primary-key probe
-- per id. (As a join, the planner may instead walk every delivery of the
-- subscription when its statistics call the table small.)
CREATE FUNCTION fastpubsub._held(p_subscription_key integer, p_ids uuid[])
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

-- Delete messages (of the given ids) that no delivery references any more.
CREATE FUNCTION fastpubsub._delete_orphan_messages(p_topic_keys integer[], p_message_ids uuid[])
RETURNS integer
LANGUAGE plpgsql
-- Lookups per candidate: never a merge or hash join over a topic's history.
SET enable_mergejoin = off
SET enable_hashjoin = off
AS $$
DECLARE
    n integer;
BEGIN
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

-- Move a subscription's consume watermark forward.
--
-- Acked and leased-away rows leave dead entries at the head of the available
-- index until VACUUM removes them, and every consume would step over all of
-- them. The watermark lets consume seek past them instead. It is safe because
-- a row only ever enters the available state with a newly drawn seq, so the
-- smallest live seq never decreases -- except that a transaction which drew a
-- seq but has not committed yet is invisible. Hence two phases:
--   1. note the smallest visible live seq as a candidate, together with the
--      xmax of the current snapshot;
--   2. once every transaction that was running then has ended (the oldest
--      running xid has passed that xmax), every row below the candidate that
--      will ever be live is visible, so the watermark becomes the smallest
--      visible live seq below the candidate, or the candidate itself.
-- Writers take their transaction id before drawing seqs, so a transaction that
-- starts later can only draw larger ones. Concurrent consumers skip the
-- subscription row when another one is updating it: never a wait.
CREATE FUNCTION fastpubsub._advance_watermark(s fastpubsub.subscriptions)
RETURNS void
LANGUAGE plpgsql
SET enable_sort = off
SET enable_bitmapscan = off
AS $$
DECLARE
    v_min bigint;
BEGIN
    IF s.consume_from_candidate IS NULL THEN
        SELECT d.seq INTO v_min FROM fastpubsub.deliveries AS d
        WHERE d.subscription_key = s.key AND d.status = 'available' AND d.seq >= s.consume_from
        ORDER BY d.seq LIMIT 1;
        IF v_min IS NULL OR v_min <= s.consume_from THEN
            RETURN;
        END IF;
        UPDATE fastpubsub.subscriptions AS x
        SET consume_from_candidate = v_min,
            consume_from_candidate_xmax = pg_snapshot_xmax(pg_current_snapshot())
        WHERE x.ctid = (SELECT y.ctid FROM fastpubsub.subscriptions AS y
                        WHERE y.key = s.key FOR NO KEY UPDATE SKIP LOCKED)
          AND x.consume_from_candidate IS NULL;
    ELSIF pg_snapshot_xmin(pg_current_snapshot()) >= s.consume_from_candidate_xmax THEN
        SELECT d.seq INTO v_min FROM fastpubsub.deliveries AS d
        WHERE d.subscription_key = s.key AND d.status = 'available'
          AND d.seq >= s.consume_from AND d.seq < s.consume_from_candidate
        ORDER BY d.seq LIMIT 1;
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

-- ---------------------------------------------------------------------------
-- Topics and subscriptions
-- ---------------------------------------------------------------------------

CREATE FUNCTION fastpubsub.create_topic(p_id text)
RETURNS fastpubsub.topics
LANGUAGE sql
AS $$
    INSERT INTO fastpubsub.topics (id) VALUES (p_id) RETURNING *
$$;

CREATE FUNCTION fastpubsub.delete_topic(p_id text)
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
    DELETE FROM fastpubsub.topics WHERE key = v_topic_key;  -- cascades to subscriptions
END
$$;

CREATE FUNCTION fastpubsub.create_subscription(
    p_id text,
    p_topic_id text,
    p_filter jsonb,
    p_max_delivery_attempts integer,
    p_backoff_min_seconds integer,
    p_backoff_max_seconds integer,
    p_ack_deadline_seconds integer
)
RETURNS fastpubsub.subscriptions
LANGUAGE plpgsql
AS $$
DECLARE
    v_topic_key integer;
    v_filter jsonb := fastpubsub._validate_filter(p_filter);
    s fastpubsub.subscriptions;
BEGIN
    SELECT key INTO v_topic_key FROM fastpubsub.topics WHERE id = p_topic_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'topic "%" not found', p_topic_id USING ERRCODE = 'FP404';
    END IF;
    PERFORM fastpubsub._lock_topic(v_topic_key, true);
    INSERT INTO fastpubsub.subscriptions AS t (
        id, topic_key, filter, max_delivery_attempts, backoff_min_seconds,
        backoff_max_seconds, ack_deadline_seconds)
    VALUES (
        p_id, v_topic_key, v_filter,
        coalesce(p_max_delivery_attempts, 5),
        coalesce(p_backoff_min_seconds, 5),
        coalesce(p_backoff_max_seconds, 300),
        coalesce(p_ack_deadline_seconds, 30))
    RETURNING * INTO s;
    RETURN s;
END
$$;

CREATE FUNCTION fastpubsub.delete_subscription(p_id text)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_id);
    v_message_ids uuid[];
BEGIN
    PERFORM fastpubsub._lock_topic(s.topic_key, true);
    DELETE FROM fastpubsub.subscriptions WHERE key = s.key;
    IF NOT EXISTS (SELECT 1 FROM fastpubsub.subscriptions WHERE topic_key = s.topic_key) THEN
        -- The last subscription of the topic: every message goes with it.
        DELETE FROM fastpubsub.deliveries WHERE subscription_key = s.key;
        DELETE FROM fastpubsub.acked_deliveries WHERE subscription_key = s.key;
        DELETE FROM fastpubsub.messages WHERE topic_key = s.topic_key;
        RETURN;
    END IF;
    WITH d AS (
        DELETE FROM fastpubsub.deliveries WHERE subscription_key = s.key RETURNING message_id
    ), a AS (
        DELETE FROM fastpubsub.acked_deliveries WHERE subscription_key = s.key RETURNING message_id
    )
    SELECT coalesce(array_agg(message_id), '{}') INTO v_message_ids
    FROM (SELECT message_id FROM d UNION SELECT message_id FROM a) AS gone;
    PERFORM fastpubsub._delete_orphan_messages(
        array_fill(s.topic_key, ARRAY[cardinality(v_message_ids)]), v_message_ids);
END
$$;

-- ---------------------------------------------------------------------------
-- Publish and consume
-- ---------------------------------------------------------------------------

-- Store the payloads (a JSON array of objects) once and fan them out to every
-- subscription of the topic whose filter matches, all or nothing. Returns the
-- message ids in input order and sends one NOTIFY for the whole call.
CREATE FUNCTION fastpubsub.publish(p_topic_id text, p_payloads jsonb)
RETURNS uuid[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_topic_key integer;
    v_now timestamptz := now();
    v_bad bigint;
    v_ids uuid[];
    v_woken text[];
BEGIN
    SELECT key INTO v_topic_key FROM fastpubsub.topics WHERE id = p_topic_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'topic "%" not found', p_topic_id USING ERRCODE = 'FP404';
    END IF;
    IF p_payloads IS NULL OR jsonb_typeof(p_payloads) <> 'array' OR jsonb_array_length(p_payloads) = 0 THEN
        RAISE EXCEPTION 'messages must be a non-empty JSON array' USING ERRCODE = 'FP422';
    END IF;
    SELECT e.ord - 1 INTO v_bad
    FROM jsonb_array_elements(p_payloads) WITH ORDINALITY AS e(payload, ord)
    WHERE jsonb_typeof(e.payload) <> 'object'
    ORDER BY e.ord LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'message at index % is not a JSON object; nothing was published', v_bad
            USING ERRCODE = 'FP422';
    END IF;

    PERFORM fastpubsub._lock_topic(v_topic_key, false);
    -- Take a transaction id before drawing queue numbers (see _advance_watermark).
    PERFORM pg_current_xact_id();

    WITH input AS MATERIALIZED (
        SELECT e.ord, e.payload, fastpubsub._message_id(v_now, e.ord - 1) AS id
        FROM jsonb_array_elements(p_payloads) WITH ORDINALITY AS e(payload, ord)
    ), routes AS MATERIALIZED (
        SELECT i.id, s.key AS subscription_key, s.id AS subscription_id
        FROM input AS i
        JOIN fastpubsub.subscriptions AS s
          ON s.topic_key = v_topic_key
         AND (s.filter IS NULL OR fastpubsub._filter_matches(s.filter, i.payload))
    ), stored AS (
        INSERT INTO fastpubsub.messages (created_at, id, topic_key, fanout, payload)
        SELECT v_now, i.id, v_topic_key, count(r.id), i.payload
        FROM input AS i LEFT JOIN routes AS r ON r.id = i.id
        GROUP BY i.ord, i.id, i.payload
    ), fanned AS (
        -- Grouped by subscription so that one consume batch touches few pages.
        INSERT INTO fastpubsub.deliveries (visible_at, seq, message_id, subscription_key, status)
        SELECT v_now, nextval('fastpubsub.delivery_seq'), r.id, r.subscription_key, 'available'
        FROM (SELECT * FROM routes ORDER BY subscription_key, id) AS r
    )
    SELECT (SELECT array_agg(i.id ORDER BY i.ord) FROM input AS i),
           (SELECT array_agg(DISTINCT r.subscription_id) FROM routes AS r)
    INTO v_ids, v_woken;

    PERFORM fastpubsub._notify(v_woken);
    RETURN v_ids;
END
$$;

-- Lease up to p_batch_size messages to p_consumer_id for the subscription's ack
-- deadline. Leases that ran out count as a failed attempt: they are delivered
-- again, or dead-lettered once max_delivery_attempts is used up. Rows locked by
-- a concurrent consume are skipped, never waited for.
CREATE FUNCTION fastpubsub.consume(p_subscription_id text, p_consumer_id text, p_batch_size integer)
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

-- A row is leased while it has a lease (run out or not: until someone else
-- takes it, the holder may still ack or nack it).

-- Seconds until something becomes deliverable without a new publish (a retry
-- backoff or a lease ending), or NULL. Long-polling consumers sleep this long
-- at most when consume found nothing; then every available row is leased, so
-- the scan below is bounded by the messages in flight.
CREATE FUNCTION fastpubsub.next_due(p_subscription_id text)
RETURNS double precision
LANGUAGE plpgsql STABLE
SET enable_sort = off
SET enable_bitmapscan = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    v_at timestamptz;
BEGIN
    SELECT least(
        (SELECT d.visible_at FROM fastpubsub.deliveries AS d
         WHERE d.subscription_key = s.key AND d.status = 'scheduled'
         ORDER BY d.visible_at LIMIT 1),
        (SELECT min(d.lease_until) FROM fastpubsub.deliveries AS d
         WHERE d.subscription_key = s.key AND d.status = 'available' AND d.seq >= s.consume_from))
    INTO v_at;
    RETURN greatest(extract(epoch FROM v_at - now())::double precision, 0);
END
$$;

-- Acknowledge leased messages; other ids are ignored. Returns how many were acked.
CREATE FUNCTION fastpubsub.ack(p_subscription_id text, p_ids uuid[])
RETURNS integer
LANGUAGE plpgsql
-- One primary-key probe per id: with statistics that say the subscription is
-- small (a new table), the planner would rather read all of it.
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
        WHERE d.ctid = ANY (fastpubsub._held(s.key, p_ids)) AND d.lease_until IS NOT NULL
        RETURNING d.message_id, d.attempts
    )
    INSERT INTO fastpubsub.acked_deliveries (acked_at, message_id, subscription_key, attempts)
    SELECT now(), gone.message_id, s.key, gone.attempts FROM gone;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- Give leased messages back: they return after an exponential backoff of
-- min(backoff_max, backoff_min * 2^(attempts-1)) seconds, or go to the DLQ once
-- max_delivery_attempts is used up. Other ids are ignored.
CREATE FUNCTION fastpubsub.nack(
    p_subscription_id text, p_ids uuid[], OUT nacked integer, OUT dead_lettered integer)
LANGUAGE plpgsql
-- One primary-key probe per id (see ack).
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
        WHERE d.ctid = ANY (fastpubsub._held(s.key, p_ids)) AND d.lease_until IS NOT NULL
        RETURNING d.status
    )
    SELECT count(*), count(*) FILTER (WHERE status = 'dlq') INTO nacked, dead_lettered FROM changed;
    IF nacked > dead_lettered AND s.backoff_min_seconds = 0 THEN
        PERFORM fastpubsub._notify(ARRAY[s.id]);
    END IF;
END
$$;

-- Move the lease deadline of leased messages to now + p_seconds.
CREATE FUNCTION fastpubsub.extend_lease(p_subscription_id text, p_ids uuid[], p_seconds integer)
RETURNS integer
LANGUAGE plpgsql
-- One primary-key probe per id, whatever the statistics say (see ack).
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
    WHERE d.ctid = ANY (fastpubsub._held(s.key, p_ids)) AND d.lease_until IS NOT NULL;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- ---------------------------------------------------------------------------
-- Dead-letter queue
-- ---------------------------------------------------------------------------

-- Move leases that ran out with no attempt left to the DLQ (consume does the
-- same as it meets them). Returns how many moved.
CREATE FUNCTION fastpubsub._settle_exhausted(s fastpubsub.subscriptions)
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
          AND x.lease_until <= now() AND x.attempts >= s.max_delivery_attempts
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- Dead-lettered messages, oldest first.
CREATE FUNCTION fastpubsub.list_dlq(p_subscription_id text, p_offset integer, p_limit integer)
RETURNS TABLE (id uuid, payload jsonb, attempts integer, created_at timestamptz)
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
        SELECT m.id, m.payload, d.attempts, m.created_at
        FROM (
            SELECT d.message_id, d.attempts FROM fastpubsub.deliveries AS d
            WHERE d.subscription_key = s.key AND d.status = 'dlq'
            ORDER BY d.message_id
            OFFSET p_offset LIMIT p_limit
        ) AS d
        CROSS JOIN LATERAL (
            SELECT m.id, m.payload, m.created_at FROM fastpubsub.messages AS m
            WHERE m.topic_key = s.topic_key AND m.id = d.message_id
            LIMIT 1
        ) AS m
        ORDER BY d.message_id;
END
$$;

-- Make dead-lettered messages deliverable again with a fresh attempt count.
CREATE FUNCTION fastpubsub.reprocess_dlq(p_subscription_id text, p_ids uuid[])
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
    IF n > 0 THEN
        PERFORM fastpubsub._notify(ARRAY[s.id]);
    END IF;
    RETURN n;
END
$$;

-- ---------------------------------------------------------------------------
-- Maintenance
-- ---------------------------------------------------------------------------

-- Delete up to p_batch_size acked deliveries older than p_older_than_seconds,
-- then the messages nothing references any more (and unrouted messages past the
-- same age). Call it until it returns fewer rows than the batch: each call is a
-- short transaction, and concurrent callers skip each other's rows.
CREATE FUNCTION fastpubsub.cleanup_acked(
    p_older_than_seconds integer, p_batch_size integer,
    OUT acked_deleted integer, OUT messages_deleted integer)
LANGUAGE plpgsql
AS $$
DECLARE
    v_cutoff timestamptz;
    v_topic_keys integer[];
    v_message_ids uuid[];
    n integer;
BEGIN
    IF p_older_than_seconds IS NULL OR p_older_than_seconds < 0 THEN
        RAISE EXCEPTION 'older than must be >= 0 seconds' USING ERRCODE = 'FP422';
    END IF;
    IF p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 1000000 THEN
        RAISE EXCEPTION 'batch size must be between 1 and 1000000' USING ERRCODE = 'FP422';
    END IF;
    v_cutoff := now() - make_interval(secs => p_older_than_seconds);

    WITH gone AS (
        DELETE FROM fastpubsub.acked_deliveries AS a
        WHERE a.ctid = ANY (ARRAY(
            SELECT x.ctid FROM fastpubsub.acked_deliveries AS x
            WHERE x.acked_at < v_cutoff
            LIMIT p_batch_size
            FOR UPDATE SKIP LOCKED))
        RETURNING a.subscription_key, a.message_id
    )
    SELECT coalesce(array_agg(s.topic_key), '{}'), coalesce(array_agg(gone.message_id), '{}'), count(*)
    INTO v_topic_keys, v_message_ids, acked_deleted
    FROM gone JOIN fastpubsub.subscriptions AS s ON s.key = gone.subscription_key;

    messages_deleted := fastpubsub._delete_orphan_messages(v_topic_keys, v_message_ids);

    DELETE FROM fastpubsub.messages AS m
    WHERE m.ctid = ANY (ARRAY(
        SELECT x.ctid FROM fastpubsub.messages AS x
        WHERE x.fanout = 0 AND x.created_at < v_cutoff
        LIMIT p_batch_size
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS n = ROW_COUNT;
    messages_deleted := messages_deleted + n;
END
$$;

-- Release leases held for longer than p_lock_timeout_seconds, even extended
-- ones (a consumer stuck in a loop): the message is deliverable again, or
-- dead-lettered when no attempt is left. A lease taken at leased_at belongs to a
-- message published before it, so only that older part of each backlog is read.
CREATE FUNCTION fastpubsub.cleanup_stuck(p_lock_timeout_seconds integer)
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_cutoff timestamptz;
    n integer;
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
              AND x.lease_until IS NOT NULL AND x.leased_at < v_cutoff
            FOR UPDATE SKIP LOCKED
        ) AS d
    ), released AS (
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
    SELECT (SELECT count(*) FROM released) + (SELECT count(*) FROM dead) INTO n;
    RETURN n;
END
$$;

-- Counts for one subscription:
--   available  deliverable now (including due retries and leases that ran out)
--   delivered  leased and within their deadline (in flight)
--   delayed    waiting for a retry backoff to end
--   acked      acked and not cleaned up yet
--   dlq        dead-lettered (including leases that ran out with no attempt left)
--   oldest_available_age_seconds  age of the oldest deliverable message (consumer lag)
CREATE FUNCTION fastpubsub.subscription_metrics(
    p_subscription_id text,
    OUT available bigint, OUT delivered bigint, OUT delayed bigint, OUT acked bigint, OUT dlq bigint,
    OUT oldest_available_age_seconds double precision)
LANGUAGE plpgsql STABLE
SET enable_sort = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    v_now timestamptz := now();
    v_due bigint;
    v_exhausted bigint;
    v_oldest uuid;
BEGIN
    SELECT count(*) FILTER (WHERE d.lease_until IS NULL
                              OR (d.lease_until <= v_now AND d.attempts < s.max_delivery_attempts)),
           count(*) FILTER (WHERE d.lease_until > v_now),
           count(*) FILTER (WHERE d.lease_until <= v_now AND d.attempts >= s.max_delivery_attempts)
    INTO available, delivered, v_exhausted
    FROM fastpubsub.deliveries AS d WHERE d.subscription_key = s.key AND d.status = 'available';

    -- The head of the queue (uuid has no min() aggregate before PostgreSQL 18).
    SELECT d.message_id INTO v_oldest
    FROM fastpubsub.deliveries AS d
    WHERE d.subscription_key = s.key AND d.status = 'available' AND d.seq >= s.consume_from
      AND (d.lease_until IS NULL OR (d.lease_until <= v_now AND d.attempts < s.max_delivery_attempts))
    ORDER BY d.seq LIMIT 1;

    SELECT count(*) FILTER (WHERE d.visible_at <= v_now), count(*) FILTER (WHERE d.visible_at > v_now)
    INTO v_due, delayed
    FROM fastpubsub.deliveries AS d WHERE d.subscription_key = s.key AND d.status = 'scheduled';

    SELECT least(v_oldest, (
        SELECT d.message_id FROM fastpubsub.deliveries AS d
        WHERE d.subscription_key = s.key AND d.status = 'scheduled' AND d.visible_at <= v_now
        ORDER BY d.message_id LIMIT 1))
    INTO v_oldest;

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
