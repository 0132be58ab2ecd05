-- Back to revision 0017_bounds_and_messages: the functions as that revision
-- had them (retention cleanup regardless of the archive, publishes of one
-- transaction sharing their first ids, NULL receipts, times past the year
-- 10000, tiny delays and impossible start dates failing with PostgreSQL's own
-- errors).

DROP FUNCTION IF EXISTS fastpubsub._cleanup_retention(integer, timestamptz);
DROP FUNCTION IF EXISTS fastpubsub._transaction_offset(jsonb);

CREATE OR REPLACE FUNCTION fastpubsub._cleanup_retention(p_batch_size integer)
RETURNS integer
LANGUAGE plpgsql
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    t record;
    v_ids uuid[];
    v_subscription_keys integer[];
    v_counted integer[];
    v_backlog bigint[];
    v_expired bigint[];
    v_deleted integer := 0;
    n integer;
BEGIN
    FOR t IN SELECT key, retention_seconds FROM fastpubsub.topics
             WHERE retention_seconds IS NOT NULL ORDER BY key LOOP
        EXIT WHEN v_deleted >= p_batch_size;
        SELECT coalesce(array_agg(m.id), '{}') INTO v_ids
        FROM (SELECT x.id FROM fastpubsub.messages AS x
              WHERE x.topic_key = t.key
                AND x.id < fastpubsub._message_id_floor(now() - make_interval(secs => t.retention_seconds))
              ORDER BY x.id
              LIMIT p_batch_size - v_deleted
              FOR UPDATE SKIP LOCKED) AS m;
        CONTINUE WHEN cardinality(v_ids) = 0;
        SELECT coalesce(array_agg(s.key), '{}') INTO v_subscription_keys
        FROM fastpubsub.subscriptions AS s WHERE s.topic_key = t.key;
        WITH gone AS (
            DELETE FROM fastpubsub.deliveries AS d
            WHERE d.subscription_key = ANY (v_subscription_keys) AND d.message_id = ANY (v_ids)
            RETURNING d.subscription_key, d.status
        ), counted AS (
            SELECT g.subscription_key AS key,
                   -count(*) FILTER (WHERE g.status <> 'dlq' AND s.max_backlog IS NOT NULL) AS backlog,
                   count(*) FILTER (WHERE g.status <> 'dlq') AS expired
            FROM gone AS g JOIN fastpubsub.subscriptions AS s ON s.key = g.subscription_key
            GROUP BY g.subscription_key
        )
        SELECT array_agg(c.key), array_agg(c.backlog), array_agg(c.expired)
        INTO v_counted, v_backlog, v_expired
        FROM counted AS c;
        PERFORM fastpubsub._count_all(v_counted, v_backlog, v_expired,
                                      array_fill(0::bigint, ARRAY[coalesce(cardinality(v_counted), 0)]));
        DELETE FROM fastpubsub.acked_deliveries AS a
        WHERE a.subscription_key = ANY (v_subscription_keys) AND a.message_id = ANY (v_ids);
        DELETE FROM fastpubsub.messages AS m WHERE m.topic_key = t.key AND m.id = ANY (v_ids);
        GET DIAGNOSTICS n = ROW_COUNT;
        v_deleted := v_deleted + n;
    END LOOP;
    RETURN v_deleted;
END
$$;

CREATE OR REPLACE FUNCTION fastpubsub.create_subscription(p_id text, p_topic_id text, p_options jsonb, p_start text)
RETURNS fastpubsub.subscriptions
LANGUAGE plpgsql
AS $$
DECLARE
    v_topic_key integer;
    v_filter jsonb;
    v_since timestamptz;
    v_push jsonb := nullif(p_options -> 'push', 'null'::jsonb);
    s fastpubsub.subscriptions;
BEGIN
    PERFORM fastpubsub._check_options(p_options, fastpubsub._subscription_options());
    v_filter := fastpubsub._validate_filter(nullif(p_options -> 'filter', 'null'::jsonb));
    IF p_start IS NULL OR p_start = 'latest' THEN
        v_since := NULL;
    ELSIF p_start = 'earliest' THEN
        v_since := '-infinity';
    ELSE
        IF p_start !~ '^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}(:?\d{2})?)$' THEN
            RAISE EXCEPTION 'start must be "latest", "earliest" or an ISO 8601 time with a time zone'
                USING ERRCODE = 'FP422';
        END IF;
        v_since := p_start::timestamptz;
    END IF;
    SELECT key INTO v_topic_key FROM fastpubsub.topics WHERE id = p_topic_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'topic "%" not found', p_topic_id USING ERRCODE = 'FP404';
    END IF;
    PERFORM fastpubsub._lock_topic(v_topic_key, true);
    INSERT INTO fastpubsub.subscriptions AS t (
        id, topic_key, filter, max_delivery_attempts, backoff_min_seconds,
        backoff_max_seconds, ack_deadline_seconds, retry_policy, retry_jitter, message_ttl_seconds,
        expiry_policy, max_backlog, backlog_policy, backfill_next, backfill_until, backfill_since, push,
        push_secret)
    VALUES (
        p_id, v_topic_key, v_filter,
        coalesce((p_options ->> 'max_delivery_attempts')::integer, 5),
        coalesce((p_options ->> 'backoff_min_seconds')::integer, 5),
        coalesce((p_options ->> 'backoff_max_seconds')::integer, 300),
        coalesce((p_options ->> 'ack_deadline_seconds')::integer, 30),
        coalesce(p_options ->> 'retry_policy', 'exponential'),
        coalesce((p_options ->> 'retry_jitter')::real, 0),
        (p_options ->> 'message_ttl_seconds')::integer,
        coalesce(p_options ->> 'expiry_policy', 'drop'),
        (p_options ->> 'max_backlog')::integer,
        coalesce(p_options ->> 'backlog_policy', 'reject'),
        -- Messages published once this lock is ours are fanned out by publish:
        -- the backfill stops at a bound past any of them committed before.
        CASE WHEN v_since = '-infinity' THEN '00000000-0000-0000-0000-000000000000'::uuid
             WHEN v_since IS NOT NULL THEN fastpubsub._message_id_floor(v_since - interval '1 second') END,
        CASE WHEN v_since IS NOT NULL THEN fastpubsub._message_id_floor(clock_timestamp() + interval '1 second') END,
        v_since,
        v_push, CASE WHEN v_push IS NOT NULL THEN p_options ->> 'push_secret' END)
    RETURNING * INTO s;
    IF s.max_backlog IS NOT NULL THEN
        PERFORM fastpubsub._note_backlog_limits(v_topic_key);
        PERFORM fastpubsub._recount_backlog(s);
    END IF;
    RETURN s;
END
$$;

CREATE OR REPLACE FUNCTION fastpubsub.seek(p_subscription_id text, p_time timestamptz, OUT replayed integer, OUT acked integer)
RETURNS record
LANGUAGE plpgsql
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    -- Message ids carry their publish time to within a fraction of a
    -- millisecond: one second either side bounds the index ranges, and
    -- messages.created_at decides exactly.
    v_from uuid;
    v_before uuid;
    n integer;
BEGIN
    IF p_time IS NULL THEN
        RAISE EXCEPTION 'seek needs a time' USING ERRCODE = 'FP422';
    END IF;
    v_from := fastpubsub._message_id_floor(p_time - interval '1 second');
    v_before := fastpubsub._message_id_floor(p_time + interval '1 second');
    PERFORM pg_current_xact_id();  -- before drawing queue numbers (see _advance_watermark)

    -- (A delayed message that was never delivered keeps its delivery time.)
    UPDATE fastpubsub.deliveries AS d
    SET status = 'available', seq = nextval('fastpubsub.delivery_seq'), attempts = 0, visible_at = now(),
        lease_until = NULL, leased_at = NULL, consumer_id = NULL
    FROM fastpubsub.messages AS m
    WHERE d.subscription_key = s.key AND d.message_id >= v_from
      AND NOT (d.status = 'scheduled' AND d.attempts = 0)
      AND m.topic_key = s.topic_key AND m.id = d.message_id AND m.created_at >= p_time;
    GET DIAGNOSTICS replayed = ROW_COUNT;

    -- (After the reset above, so that rows brought back are not reset twice.)
    WITH back AS (
        DELETE FROM fastpubsub.acked_deliveries AS a
        USING fastpubsub.messages AS m
        WHERE a.subscription_key = s.key AND a.message_id >= v_from
          AND m.topic_key = s.topic_key AND m.id = a.message_id AND m.created_at >= p_time
        RETURNING a.message_id, m.priority
    )
    INSERT INTO fastpubsub.deliveries (visible_at, seq, message_id, subscription_key, status, attempts, priority)
    SELECT now(), nextval('fastpubsub.delivery_seq'), back.message_id, s.key, 'available', 0, back.priority
    FROM (SELECT * FROM back ORDER BY message_id) AS back;
    GET DIAGNOSTICS n = ROW_COUNT;
    replayed := replayed + n;

    WITH gone AS (
        DELETE FROM fastpubsub.deliveries AS d
        USING fastpubsub.messages AS m
        WHERE d.subscription_key = s.key AND d.message_id < v_before
          AND m.topic_key = s.topic_key AND m.id = d.message_id AND m.created_at < p_time
        RETURNING d.message_id, d.attempts
    )
    INSERT INTO fastpubsub.acked_deliveries (acked_at, message_id, subscription_key, attempts)
    SELECT now(), gone.message_id, s.key, gone.attempts FROM gone;
    GET DIAGNOSTICS acked = ROW_COUNT;

    IF s.max_backlog IS NOT NULL THEN
        PERFORM fastpubsub._recount_backlog(s);
    END IF;
    IF replayed > 0 THEN
        PERFORM fastpubsub._notify(ARRAY[s.id], ARRAY[replayed]);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION fastpubsub.publish_v2(p_topic_id text, p_messages jsonb, p_envelopes boolean)
RETURNS uuid[]
LANGUAGE sql VOLATILE
AS $$
    SELECT (fastpubsub._publish(p_topic_id, p_messages, p_envelopes, 0)).ids
$$;

CREATE OR REPLACE FUNCTION fastpubsub._message_id_floor(p_time timestamptz)
RETURNS uuid
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT encode(
        substring(int8send(t.units >> 12) FROM 3 FOR 6)
        || substring(int4send(((t.units & 4095) | 28672)::integer) FROM 3 FOR 2)
        || '\x0000000000000000'::bytea,
        'hex')::uuid
    FROM (SELECT floor(extract(epoch FROM greatest(p_time, 'epoch'::timestamptz)) * 4096000)::bigint AS units) AS t
$$;

CREATE OR REPLACE FUNCTION fastpubsub.cleanup_acked(
    p_older_than_seconds integer, p_batch_size integer, p_archived_in text,
    OUT acked_deleted integer, OUT messages_deleted integer)
RETURNS record
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
    IF p_archived_in IS NOT NULL THEN
        v_cutoff := least(v_cutoff, fastpubsub.archive_watermark(p_archived_in));
    END IF;

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
    messages_deleted := messages_deleted + fastpubsub._cleanup_retention(p_batch_size);
END
$$;

CREATE OR REPLACE FUNCTION fastpubsub._publish(
    p_topic_id text, p_messages jsonb, p_envelopes boolean, p_offset bigint,
    OUT ids uuid[], OUT woken text[], OUT woken_counts integer[])
RETURNS record
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_topic_key integer;
    v_now timestamptz := now();
    v_problem text;
    v_ids uuid[];
    v_keys text[];
    v_store boolean[];
    v_limited boolean;
    v_expiring boolean;
    v_xid xid8;
BEGIN
    SELECT key, backlog_limited INTO v_topic_key, v_limited FROM fastpubsub.topics WHERE id = p_topic_id;
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

    -- _lock_topic(v_topic_key, false), and the transaction's id before drawing
    -- queue numbers (see _advance_watermark), written out: each statement of a
    -- function costs tens of microseconds, and this runs for every publish.
    PERFORM pg_advisory_xact_lock_shared(1718645602, v_topic_key);
    v_xid := pg_current_xact_id();

    SELECT array_agg(fastpubsub._message_id(v_now, p_offset + e.ord - 1) ORDER BY e.ord),
           array_agg(CASE WHEN p_envelopes THEN e.value ->> 'idempotency_key' END ORDER BY e.ord),
           bool_or(p_envelopes AND (e.value ? 'ttl_seconds' OR e.value ? 'expires_at'))
    INTO v_ids, v_keys, v_expiring
    FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS e(value, ord);
    ids := v_ids;
    v_store := array_fill(true, ARRAY[cardinality(v_ids)]);

    IF cardinality(array_remove(v_keys, NULL)) > 0 THEN
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
        INTO ids
        FROM unnest(v_keys, v_ids) WITH ORDINALITY AS x(key, id, ord)
        LEFT JOIN fastpubsub.idempotency_keys AS k ON k.topic_key = v_topic_key AND k.key = x.key;
    END IF;

    IF v_limited THEN
        PERFORM fastpubsub._make_room(v_topic_key, p_messages, p_envelopes, v_store);
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
                    THEN (e.value ->> 'priority')::numeric::smallint ELSE 0::smallint END AS priority,
               CASE WHEN NOT v_expiring THEN NULL
                    WHEN jsonb_typeof(e.value -> 'expires_at') = 'string' THEN (e.value ->> 'expires_at')::timestamptz
                    WHEN jsonb_typeof(e.value -> 'ttl_seconds') = 'number'
                        THEN v_now + make_interval(secs => (e.value ->> 'ttl_seconds')::double precision)
                    END AS expires_at
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
        INSERT INTO fastpubsub.messages (created_at, id, topic_key, fanout, payload, attributes, priority, expires_at)
        SELECT v_now, i.id, v_topic_key, count(r.id), i.payload, i.attributes, i.priority, i.expires_at
        FROM input AS i LEFT JOIN routes AS r ON r.id = i.id
        GROUP BY i.ord, i.id, i.payload, i.attributes, i.priority, i.expires_at
    ), fanned AS (
        -- Grouped by subscription so that one consume batch touches few pages.
        INSERT INTO fastpubsub.deliveries (visible_at, seq, message_id, subscription_key, status, priority)
        SELECT r.visible_at, nextval('fastpubsub.delivery_seq'), r.id, r.subscription_key,
               CASE WHEN r.visible_at > v_now THEN 'scheduled' ELSE 'available' END::fastpubsub.delivery_status,
               r.priority
        FROM (SELECT * FROM routes ORDER BY subscription_key, id) AS r
    )
    SELECT coalesce(array_agg(w.subscription_id ORDER BY w.subscription_id), '{}'),
           coalesce(array_agg(w.ready ORDER BY w.subscription_id), '{}')
    INTO woken, woken_counts
    FROM (SELECT r.subscription_id, count(*) FILTER (WHERE r.visible_at <= v_now)::integer AS ready
          FROM routes AS r GROUP BY r.subscription_id) AS w;

    IF v_expiring THEN
        -- From now on consume reads these subscriptions' messages' own expiry.
        UPDATE fastpubsub.subscriptions SET expiring_messages = true
        WHERE topic_key = v_topic_key AND id = ANY (woken) AND NOT expiring_messages;
    END IF;
    IF current_setting('fastpubsub.notify', true) IS DISTINCT FROM 'off' THEN  -- the server's sessions: off
        PERFORM fastpubsub._notify(woken, woken_counts);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION fastpubsub.publish(p_topic_id text, p_payloads jsonb)
RETURNS uuid[]
LANGUAGE sql VOLATILE
AS $$
    SELECT (fastpubsub._publish(p_topic_id, p_payloads, false, 0)).ids
$$;

CREATE OR REPLACE FUNCTION fastpubsub.publish_envelopes(p_topic_id text, p_envelopes jsonb)
RETURNS uuid[]
LANGUAGE sql VOLATILE
AS $$
    SELECT (fastpubsub._publish(p_topic_id, p_envelopes, true, 0)).ids
$$;

CREATE OR REPLACE FUNCTION fastpubsub.ack_receipts(p_subscription_id text, p_receipts text[])
RETURNS TABLE(receipt text, outcome text)
LANGUAGE sql
AS $$
    SELECT * FROM fastpubsub._settle_receipts(jsonb_build_object(
        'subscription', p_subscription_id, 'action', 'ack', 'receipts', to_jsonb(p_receipts)))
$$;

CREATE OR REPLACE FUNCTION fastpubsub.nack_receipts(p_subscription_id text, p_receipts text[], p_requeue boolean)
RETURNS TABLE(receipt text, outcome text)
LANGUAGE sql
AS $$
    SELECT * FROM fastpubsub._settle_receipts(jsonb_build_object(
        'subscription', p_subscription_id, 'action', 'nack', 'receipts', to_jsonb(p_receipts),
        'requeue', coalesce(p_requeue, true)))
$$;

CREATE OR REPLACE FUNCTION fastpubsub.extend_lease_receipts(
    p_subscription_id text, p_receipts text[], p_seconds integer)
RETURNS TABLE(receipt text, outcome text)
LANGUAGE sql
AS $$
    SELECT * FROM fastpubsub._settle_receipts(jsonb_build_object(
        'subscription', p_subscription_id, 'action', 'extend', 'receipts', to_jsonb(p_receipts),
        'seconds', p_seconds))
$$;

