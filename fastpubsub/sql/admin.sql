-- Topics and subscriptions: create, change, delete, replay.

-- A new topic; 23505 (unique violation) when the id is taken.
CREATE OR REPLACE FUNCTION fastpubsub.create_topic(p_id text)
RETURNS fastpubsub.topics
LANGUAGE sql
AS $$
    INSERT INTO fastpubsub.topics (id) VALUES (p_id) RETURNING *
$$;

-- Delete a topic with its subscriptions, messages, deliveries and idempotency
-- keys. Every delete walks a primary-key prefix: no table scans.
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
    DELETE FROM fastpubsub.subscription_counts WHERE subscription_key = ANY (v_subscription_keys);
    DELETE FROM fastpubsub.topics WHERE key = v_topic_key;  -- cascades to subscriptions
END
$$;

-- A new topic with options: {"retention_seconds": n}; 23505 when the id is taken.
CREATE OR REPLACE FUNCTION fastpubsub.create_topic(p_id text, p_options jsonb)
RETURNS fastpubsub.topics
LANGUAGE plpgsql
AS $$
DECLARE
    t fastpubsub.topics;
BEGIN
    PERFORM fastpubsub._check_options(p_options, ARRAY['retention_seconds']);
    INSERT INTO fastpubsub.topics (id, retention_seconds)
    VALUES (p_id, (p_options ->> 'retention_seconds')::integer)
    RETURNING * INTO t;
    RETURN t;
END
$$;

-- Change a topic: each key of p_changes present is set (null clears it).
CREATE OR REPLACE FUNCTION fastpubsub.update_topic(p_id text, p_changes jsonb)
RETURNS fastpubsub.topics
LANGUAGE plpgsql
AS $$
DECLARE
    t fastpubsub.topics;
BEGIN
    PERFORM fastpubsub._check_options(p_changes, ARRAY['retention_seconds']);
    UPDATE fastpubsub.topics
    SET retention_seconds = CASE WHEN p_changes ? 'retention_seconds'
                                 THEN (p_changes ->> 'retention_seconds')::integer ELSE retention_seconds END
    WHERE id = p_id
    RETURNING * INTO t;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'topic "%" not found', p_id USING ERRCODE = 'FP404';
    END IF;
    RETURN t;
END
$$;

-- FP422 unless p_options is an object (or NULL) whose keys are all in p_known.
CREATE OR REPLACE FUNCTION fastpubsub._check_options(p_options jsonb, p_known text[])
RETURNS void
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_key text;
BEGIN
    IF p_options IS NULL THEN
        RETURN;
    END IF;
    IF jsonb_typeof(p_options) <> 'object' THEN
        RAISE EXCEPTION 'options must be a JSON object' USING ERRCODE = 'FP422';
    END IF;
    SELECT k INTO v_key FROM jsonb_object_keys(p_options) AS k WHERE k <> ALL (p_known) ORDER BY k LIMIT 1;
    IF v_key IS NOT NULL THEN
        RAISE EXCEPTION 'unknown option "%"', v_key USING ERRCODE = 'FP422';
    END IF;
END
$$;

-- The subscription options create_subscription and update_subscription take.
CREATE OR REPLACE FUNCTION fastpubsub._subscription_options()
RETURNS text[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ARRAY['filter', 'max_delivery_attempts', 'backoff_min_seconds', 'backoff_max_seconds',
                 'ack_deadline_seconds', 'retry_policy', 'retry_jitter', 'message_ttl_seconds', 'expiry_policy',
                 'max_backlog', 'backlog_policy', 'push', 'push_secret']
$$;

-- Keep topics.backlog_limited true exactly while a subscription of the topic
-- has a max_backlog (callers hold the topic's exclusive lock).
CREATE OR REPLACE FUNCTION fastpubsub._note_backlog_limits(p_topic_key integer)
RETURNS void
LANGUAGE sql
AS $$
    UPDATE fastpubsub.topics AS t
    SET backlog_limited = EXISTS (SELECT 1 FROM fastpubsub.subscriptions AS s
                                  WHERE s.topic_key = p_topic_key AND s.max_backlog IS NOT NULL)
    WHERE t.key = p_topic_key
$$;

-- Count a subscription's backlog exactly (waiting, in flight and delayed, not
-- dead letters): for a limit just set, or after a replay. Reads its whole
-- backlog through the partial indexes, so only administration calls it.
CREATE OR REPLACE FUNCTION fastpubsub._recount_backlog(s fastpubsub.subscriptions)
RETURNS bigint
LANGUAGE plpgsql
AS $$
DECLARE
    n bigint;
BEGIN
    SELECT (SELECT count(*) FROM fastpubsub.deliveries AS d
            WHERE d.subscription_key = s.key AND d.status = 'available')
         + (SELECT count(*) FROM fastpubsub.deliveries AS d
            WHERE d.subscription_key = s.key AND d.status = 'scheduled')
    INTO n;
    INSERT INTO fastpubsub.subscription_counts AS c (subscription_key, backlog) VALUES (s.key, n)
    ON CONFLICT (subscription_key) DO UPDATE SET backlog = excluded.backlog;
    RETURN n;
END
$$;

-- A new subscription of a topic. p_options (all optional): filter,
-- max_delivery_attempts, backoff_min_seconds, backoff_max_seconds,
-- ack_deadline_seconds, retry_policy, retry_jitter, message_ttl_seconds,
-- expiry_policy, max_backlog, backlog_policy (absent or null: the default),
-- push (see subscriptions.push; absent or null: a pull subscription) and
-- push_secret, the secret that signs a push subscription's requests.
-- p_start says which messages it receives: NULL or 'latest', those published
-- from now on; 'earliest', also every message of the topic still retained;
-- an ISO 8601 time, also those retained that were published from then on.
-- The retained ones are added afterwards by `backfill`, in batches (see
-- there). FP404 for an unknown topic, FP422 for a bad filter, option or start,
-- 23505 when the id is taken, 23514 when a value is out of range or a push
-- configuration has no endpoint or no secret.
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
        BEGIN
            v_since := p_start::timestamptz;
        EXCEPTION WHEN data_exception THEN  -- February 30th, the year 0, ...
            RAISE EXCEPTION 'start "%" is not a valid time', p_start USING ERRCODE = 'FP422';
        END;
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

-- Change a subscription: each key of p_changes present is set (null: the
-- filter, message_ttl_seconds and max_backlog are removed, the others go back
-- to their defaults). push null makes it a pull subscription again and forgets
-- its secrets; a subscription that becomes a push subscription is signed with
-- push_secret, one that was already keeps its secret. A new filter applies to
-- messages published afterwards; a new retry policy to attempts that fail
-- afterwards. Takes the topic's lock, so that a publish sees the subscription
-- wholly before or after the change.
CREATE OR REPLACE FUNCTION fastpubsub.update_subscription(p_id text, p_changes jsonb)
RETURNS fastpubsub.subscriptions
LANGUAGE plpgsql
AS $$
DECLARE
    c jsonb := coalesce(p_changes, '{}'::jsonb);
    v_filter jsonb;
    v_push jsonb;
    s fastpubsub.subscriptions;
BEGIN
    PERFORM fastpubsub._check_options(c, fastpubsub._subscription_options());
    IF c ? 'filter' THEN
        v_filter := fastpubsub._validate_filter(nullif(c -> 'filter', 'null'::jsonb));
    END IF;
    IF c ? 'push' THEN
        v_push := nullif(c -> 'push', 'null'::jsonb);
    END IF;
    s := fastpubsub._subscription(p_id);
    PERFORM fastpubsub._lock_topic(s.topic_key, true);
    UPDATE fastpubsub.subscriptions AS x
    SET filter = CASE WHEN c ? 'filter' THEN v_filter ELSE x.filter END,
        max_delivery_attempts = CASE WHEN c ? 'max_delivery_attempts'
            THEN coalesce((c ->> 'max_delivery_attempts')::integer, 5) ELSE x.max_delivery_attempts END,
        backoff_min_seconds = CASE WHEN c ? 'backoff_min_seconds'
            THEN coalesce((c ->> 'backoff_min_seconds')::integer, 5) ELSE x.backoff_min_seconds END,
        backoff_max_seconds = CASE WHEN c ? 'backoff_max_seconds'
            THEN coalesce((c ->> 'backoff_max_seconds')::integer, 300) ELSE x.backoff_max_seconds END,
        ack_deadline_seconds = CASE WHEN c ? 'ack_deadline_seconds'
            THEN coalesce((c ->> 'ack_deadline_seconds')::integer, 30) ELSE x.ack_deadline_seconds END,
        retry_policy = CASE WHEN c ? 'retry_policy'
            THEN coalesce(c ->> 'retry_policy', 'exponential') ELSE x.retry_policy END,
        retry_jitter = CASE WHEN c ? 'retry_jitter'
            THEN coalesce((c ->> 'retry_jitter')::real, 0) ELSE x.retry_jitter END,
        message_ttl_seconds = CASE WHEN c ? 'message_ttl_seconds'
            THEN (c ->> 'message_ttl_seconds')::integer ELSE x.message_ttl_seconds END,
        expiry_policy = CASE WHEN c ? 'expiry_policy'
            THEN coalesce(c ->> 'expiry_policy', 'drop') ELSE x.expiry_policy END,
        max_backlog = CASE WHEN c ? 'max_backlog' THEN (c ->> 'max_backlog')::integer ELSE x.max_backlog END,
        backlog_policy = CASE WHEN c ? 'backlog_policy'
            THEN coalesce(c ->> 'backlog_policy', 'reject') ELSE x.backlog_policy END,
        push = CASE WHEN c ? 'push' THEN v_push ELSE x.push END,
        push_secret = CASE WHEN NOT c ? 'push' THEN x.push_secret
                           WHEN v_push IS NOT NULL THEN coalesce(x.push_secret, c ->> 'push_secret') END,
        push_previous_secret = CASE WHEN c ? 'push' AND v_push IS NULL THEN NULL
                                    ELSE x.push_previous_secret END,
        push_previous_secret_until = CASE WHEN c ? 'push' AND v_push IS NULL THEN NULL
                                          ELSE x.push_previous_secret_until END,
        updated_at = now()
    WHERE x.key = s.key
    RETURNING * INTO s;
    IF c ? 'max_backlog' THEN
        PERFORM fastpubsub._note_backlog_limits(s.topic_key);
        IF s.max_backlog IS NOT NULL THEN
            PERFORM fastpubsub._recount_backlog(s);  -- it was not counted while there was no limit
        END IF;
    END IF;
    RETURN s;
END
$$;

-- A push subscription signs with p_secret from now on; its current secret
-- keeps signing too (each request then carries both signatures) for
-- p_grace_seconds, so receivers can move to the new one without losing a
-- request. FP404 for an unknown subscription, FP422 for a pull subscription.
CREATE OR REPLACE FUNCTION fastpubsub.rotate_push_secret(p_subscription_id text, p_secret text, p_grace_seconds integer)
RETURNS fastpubsub.subscriptions
LANGUAGE plpgsql
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
BEGIN
    IF s.push IS NULL THEN
        RAISE EXCEPTION 'subscription "%" is not a push subscription', p_subscription_id USING ERRCODE = 'FP422';
    END IF;
    IF p_secret IS NULL OR p_grace_seconds IS NULL OR p_grace_seconds NOT BETWEEN 0 AND 604800 THEN
        RAISE EXCEPTION 'a rotation needs a secret and a grace period of 0 to 604800 seconds'
            USING ERRCODE = 'FP422';
    END IF;
    UPDATE fastpubsub.subscriptions
    SET push_secret = p_secret,
        push_previous_secret = CASE WHEN p_grace_seconds > 0 THEN push_secret END,
        push_previous_secret_until = CASE WHEN p_grace_seconds > 0
                                          THEN now() + make_interval(secs => p_grace_seconds) END,
        updated_at = now()
    WHERE key = s.key
    RETURNING * INTO s;
    RETURN s;
END
$$;

-- Add up to p_batch_size of the retained messages a subscription created
-- with a start position asked for (see create_subscription): those of its
-- topic, oldest first, published at or after its start, accepted by its filter
-- and not expired, that publish did not route to it already. Each call is one
-- short transaction; call it until `done` (the server does, in the background,
-- from the moment the subscription is created). Meanwhile the subscription
-- receives new messages as usual, and the retained ones join its queue as
-- they are added, behind what is waiting then. `busy`: another transaction
-- holds the subscription (filling or changing it); nothing was done.
CREATE OR REPLACE FUNCTION fastpubsub.backfill(p_subscription_id text, p_batch_size integer,
                                               OUT added integer, OUT done boolean, OUT busy boolean)
RETURNS record
LANGUAGE plpgsql
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    s fastpubsub.subscriptions;
    v_now timestamptz := now();
    v_last uuid;
    v_seen integer;
BEGIN
    IF p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 100000 THEN
        RAISE EXCEPTION 'batch size must be between 1 and 100000' USING ERRCODE = 'FP422';
    END IF;
    s := fastpubsub._subscription(p_subscription_id);
    added := 0;
    busy := false;
    IF s.backfill_next IS NULL THEN
        done := true;
        RETURN;
    END IF;
    -- One filler at a time; a delete or a change of the subscription waits for this batch.
    SELECT * INTO s FROM fastpubsub.subscriptions WHERE key = s.key FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        done := false;
        busy := true;
        RETURN;
    END IF;
    PERFORM pg_current_xact_id();  -- before drawing queue numbers (see _advance_watermark)
    -- FOR KEY SHARE: cleanup, which locks a message before deleting it, waits
    -- for this transaction and then sees the delivery added here.
    WITH batch AS MATERIALIZED (
        SELECT m.id, m.created_at, m.payload, m.attributes, m.priority, m.expires_at
        FROM fastpubsub.messages AS m
        WHERE m.topic_key = s.topic_key AND m.id > s.backfill_next AND m.id < s.backfill_until
        ORDER BY m.id
        LIMIT p_batch_size
        FOR KEY SHARE
    ), wanted AS (
        SELECT b.id, b.priority FROM batch AS b
        WHERE b.created_at >= s.backfill_since
          AND (b.expires_at IS NULL OR b.expires_at > v_now)
          AND (s.message_ttl_seconds IS NULL
               OR b.created_at > v_now - make_interval(secs => s.message_ttl_seconds))
          AND (s.filter IS NULL
               OR CASE WHEN s.filter_simple THEN fastpubsub._filter_matches_seed(s.filter, b.payload)
                       ELSE fastpubsub._filter_eval(s.filter, b.payload, b.attributes) END)
          AND NOT EXISTS (SELECT 1 FROM fastpubsub.acked_deliveries AS a
                          WHERE a.subscription_key = s.key AND a.message_id = b.id)
    ), inserted AS (
        INSERT INTO fastpubsub.deliveries (visible_at, seq, message_id, subscription_key, status, priority)
        SELECT v_now, nextval('fastpubsub.delivery_seq'), w.id, s.key, 'available', w.priority
        FROM (SELECT * FROM wanted ORDER BY id) AS w
        ON CONFLICT DO NOTHING
        RETURNING message_id
    ), routed AS (
        -- A message no subscription wanted is routed now: cleanup keeps it.
        UPDATE fastpubsub.messages AS m SET fanout = 1
        FROM inserted AS i
        WHERE m.topic_key = s.topic_key AND m.id = i.message_id AND m.fanout = 0
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM inserted) + 0 * (SELECT count(*) FROM routed), (SELECT count(*) FROM batch), (SELECT max(id::text) FROM batch)::uuid
    INTO added, v_seen, v_last;
    done := v_seen < p_batch_size;
    UPDATE fastpubsub.subscriptions
    SET backfill_next = CASE WHEN done THEN NULL ELSE v_last END,
        backfill_until = CASE WHEN done THEN NULL ELSE backfill_until END,
        backfill_since = CASE WHEN done THEN NULL ELSE backfill_since END
    WHERE key = s.key;
    IF added > 0 THEN
        IF s.max_backlog IS NOT NULL THEN
            PERFORM fastpubsub._count(s.key, added, 0, 0);
        END IF;
        PERFORM fastpubsub._notify(ARRAY[s.id], ARRAY[added]);
    END IF;
END
$$;

-- Delete a subscription with its deliveries and acked history; messages no
-- other subscription of the topic still refers to go too.
CREATE OR REPLACE FUNCTION fastpubsub.delete_subscription(p_id text)
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_id);
    v_message_ids uuid[];
BEGIN
    PERFORM fastpubsub._lock_topic(s.topic_key, true);
    DELETE FROM fastpubsub.subscriptions WHERE key = s.key;
    DELETE FROM fastpubsub.subscription_counts WHERE subscription_key = s.key;
    IF s.max_backlog IS NOT NULL THEN
        PERFORM fastpubsub._note_backlog_limits(s.topic_key);
    END IF;
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

-- Replay: messages of the subscription published at or after p_time that are
-- still retained become deliverable again with a fresh attempt count (acked,
-- dead-lettered and leased ones included); earlier pending ones count as
-- acked. Retention is the acked-cleanup window.
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
    -- (Past the year 10000, which no id reaches, a second more could overflow.)
    v_from := fastpubsub._message_id_floor(least(p_time, '10000-01-01 00:00:00+00') - interval '1 second');
    v_before := fastpubsub._message_id_floor(least(p_time, '10000-01-01 00:00:00+00') + interval '1 second');
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
