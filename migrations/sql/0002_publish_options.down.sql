-- Undo 0002: drop what it added and give the functions it replaced their
-- 0001 bodies back.
DROP FUNCTION fastpubsub.cleanup_idempotency_keys(integer, integer);
DROP FUNCTION fastpubsub.seek(text, timestamptz);
DROP FUNCTION fastpubsub.update_subscription(text, boolean, jsonb, integer, integer, integer, integer);
DROP FUNCTION fastpubsub.touch_stream(text);
DROP FUNCTION fastpubsub.consume_v2(text, text, integer);
CREATE OR REPLACE FUNCTION fastpubsub.next_due(p_subscription_id text)
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

DROP FUNCTION fastpubsub._advance_watermark_v2(fastpubsub.subscriptions);
DROP FUNCTION fastpubsub._next_priority(integer, smallint);
DROP FUNCTION fastpubsub.publish_v2(text, jsonb, boolean);
DROP FUNCTION fastpubsub._envelope_problem(jsonb, bigint);

CREATE OR REPLACE FUNCTION fastpubsub._filter_matches(p_filter jsonb, p_payload jsonb)
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

CREATE OR REPLACE FUNCTION fastpubsub._validate_filter(p_filter jsonb)
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

CREATE OR REPLACE FUNCTION fastpubsub.ack(p_subscription_id text, p_ids uuid[])
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

CREATE OR REPLACE FUNCTION fastpubsub.nack(
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

DROP FUNCTION fastpubsub._validate_filter_node(jsonb, text, integer, boolean, integer);
DROP FUNCTION fastpubsub._filter_eval(jsonb, jsonb, jsonb);
DROP FUNCTION fastpubsub._condition_matches(jsonb, jsonb);
DROP FUNCTION fastpubsub._amqp_match(text[], text[]);
DROP FUNCTION fastpubsub._filter_matches_seed(jsonb, jsonb);
ALTER TABLE fastpubsub.subscriptions DROP COLUMN filter_simple;
DROP FUNCTION fastpubsub._filter_is_simple(jsonb);

DROP TABLE fastpubsub.idempotency_keys;
CREATE INDEX deliveries_available_idx ON fastpubsub.deliveries (subscription_key, seq)
    WHERE status = 'available';
DROP INDEX fastpubsub.deliveries_ready_idx;
ALTER TABLE fastpubsub.subscriptions DROP COLUMN streaming_until;
ALTER TABLE fastpubsub.deliveries DROP COLUMN priority;
ALTER TABLE fastpubsub.messages DROP COLUMN priority, DROP COLUMN attributes;
