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
    DELETE FROM fastpubsub.topics WHERE key = v_topic_key;  -- cascades to subscriptions
END
$$;

-- A new subscription of a topic; it receives messages published from now on.
-- NULL policies take the defaults. FP404 for an unknown topic, FP422 for a bad
-- filter, 23505 when the id is taken, 23514 when a policy is out of range.
CREATE OR REPLACE FUNCTION fastpubsub.create_subscription(p_id text, p_topic_id text, p_filter jsonb, p_max_delivery_attempts integer, p_backoff_min_seconds integer, p_backoff_max_seconds integer, p_ack_deadline_seconds integer)
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

-- Change a subscription's filter (when p_set_filter) and policies (NULL keeps
-- the current value). A new filter applies to messages published afterwards.
CREATE OR REPLACE FUNCTION fastpubsub.update_subscription(p_id text, p_set_filter boolean, p_filter jsonb, p_max_delivery_attempts integer, p_backoff_min_seconds integer, p_backoff_max_seconds integer, p_ack_deadline_seconds integer)
RETURNS fastpubsub.subscriptions
LANGUAGE plpgsql
AS $$
DECLARE
    v_filter jsonb := CASE WHEN p_set_filter THEN fastpubsub._validate_filter(p_filter) END;
    s fastpubsub.subscriptions;
BEGIN
    UPDATE fastpubsub.subscriptions
    SET filter = CASE WHEN p_set_filter THEN v_filter ELSE filter END,
        max_delivery_attempts = coalesce(p_max_delivery_attempts, max_delivery_attempts),
        backoff_min_seconds = coalesce(p_backoff_min_seconds, backoff_min_seconds),
        backoff_max_seconds = coalesce(p_backoff_max_seconds, backoff_max_seconds),
        ack_deadline_seconds = coalesce(p_ack_deadline_seconds, ack_deadline_seconds),
        updated_at = now()
    WHERE id = p_id
    RETURNING * INTO s;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'subscription "%" not found', p_id USING ERRCODE = 'FP404';
    END IF;
    RETURN s;
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

    IF replayed > 0 THEN
        PERFORM fastpubsub._notify(ARRAY[s.id], ARRAY[replayed]);
    END IF;
END
$$;
