-- Publish options (attributes, idempotency keys, delay, priority), rich filters,
-- subscription updates, seek/replay and streaming wake-ups.
--
-- New entry points get a _v2 suffix (publish_v2, consume_v2) and the v1
-- functions keep working, so servers still running the previous release are
-- not broken while this one rolls out. Private helpers (_filter_matches,
-- _validate_filter) and ack/nack keep their signatures and get new bodies.

ALTER TABLE fastpubsub.messages
    ADD COLUMN attributes jsonb,
    ADD COLUMN priority smallint NOT NULL DEFAULT 0;

ALTER TABLE fastpubsub.deliveries
    ADD COLUMN priority smallint NOT NULL DEFAULT 0;

-- Streams register here (touch_stream) so that acks and nacks wake them: only
-- subscriptions with a live stream pay for a NOTIFY per ack.
ALTER TABLE fastpubsub.subscriptions
    ADD COLUMN streaming_until timestamptz;

-- Consume takes the highest priority first, queue order within a priority.
CREATE INDEX deliveries_ready_idx ON fastpubsub.deliveries (subscription_key, priority, seq)
    WHERE status = 'available';
DROP INDEX fastpubsub.deliveries_available_idx;

-- A repeated idempotency key on a topic returns the original message id.
CREATE TABLE fastpubsub.idempotency_keys (
    topic_key integer NOT NULL,
    key text NOT NULL,
    message_id uuid NOT NULL,
    created_at timestamptz NOT NULL,
    PRIMARY KEY (topic_key, key)
);
CREATE INDEX idempotency_keys_created_at_brin ON fastpubsub.idempotency_keys USING brin (created_at);

-- ---------------------------------------------------------------------------
-- Filters
-- ---------------------------------------------------------------------------

-- A seed-format filter: top-level field names mapping to lists of allowed values.
CREATE FUNCTION fastpubsub._filter_is_simple(p_filter jsonb)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT p_filter IS NULL OR (
        jsonb_typeof(p_filter) = 'object'
        AND NOT EXISTS (
            SELECT 1 FROM jsonb_each(p_filter) AS f(key, value)
            WHERE f.key LIKE '$%' OR position('.' IN f.key) > 0 OR jsonb_typeof(f.value) <> 'array'
        )
    )
$$;

ALTER TABLE fastpubsub.subscriptions
    ADD COLUMN filter_simple boolean GENERATED ALWAYS AS (fastpubsub._filter_is_simple(filter)) STORED;

-- The seed semantics, written so that PostgreSQL can inline it into publish.
CREATE FUNCTION fastpubsub._filter_matches_seed(p_filter jsonb, p_payload jsonb)
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

-- AMQP-style topic match on dot-separated words: `*` is exactly one word,
-- `#` zero or more.
CREATE FUNCTION fastpubsub._amqp_match(p_words text[], p_pattern text[])
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
BEGIN
    IF cardinality(p_pattern) = 0 THEN
        RETURN cardinality(p_words) = 0;
    END IF;
    IF p_pattern[1] = '#' THEN
        IF fastpubsub._amqp_match(p_words, p_pattern[2:]) THEN
            RETURN true;
        END IF;
        IF cardinality(p_words) = 0 THEN
            RETURN false;
        END IF;
        RETURN fastpubsub._amqp_match(p_words[2:], p_pattern);
    END IF;
    IF cardinality(p_words) = 0 THEN
        RETURN false;
    END IF;
    IF p_pattern[1] = '*' OR p_pattern[1] = p_words[1] THEN
        RETURN fastpubsub._amqp_match(p_words[2:], p_pattern[2:]);
    END IF;
    RETURN false;
END
$$;

-- One field condition against the value found at its path (NULL when absent).
CREATE FUNCTION fastpubsub._condition_matches(p_condition jsonb, p_value jsonb)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    op record;
    holds boolean;
BEGIN
    IF jsonb_typeof(p_condition) = 'array' THEN
        RETURN p_value IS NOT NULL
            AND EXISTS (SELECT 1 FROM jsonb_array_elements(p_condition) AS a(v) WHERE a.v = p_value);
    END IF;
    FOR op IN SELECT key, value FROM jsonb_each(p_condition) LOOP
        CASE op.key
            WHEN '$in' THEN
                IF p_value IS NULL
                   OR NOT EXISTS (SELECT 1 FROM jsonb_array_elements(op.value) AS a(v) WHERE a.v = p_value) THEN
                    RETURN false;
                END IF;
            WHEN '$nin' THEN
                IF p_value IS NOT NULL
                   AND EXISTS (SELECT 1 FROM jsonb_array_elements(op.value) AS a(v) WHERE a.v = p_value) THEN
                    RETURN false;
                END IF;
            WHEN '$eq' THEN
                IF p_value IS NULL OR p_value <> op.value THEN
                    RETURN false;
                END IF;
            WHEN '$ne' THEN
                IF p_value IS NOT NULL AND p_value = op.value THEN
                    RETURN false;
                END IF;
            WHEN '$exists' THEN
                IF (p_value IS NOT NULL) <> (op.value = 'true'::jsonb) THEN
                    RETURN false;
                END IF;
            WHEN '$gt', '$gte', '$lt', '$lte' THEN
                IF jsonb_typeof(p_value) IS DISTINCT FROM 'number' THEN
                    RETURN false;
                END IF;
                -- (assigned first: inside IF, plpgsql would end the condition at CASE's THEN)
                holds := CASE op.key
                    WHEN '$gt' THEN p_value::numeric > op.value::numeric
                    WHEN '$gte' THEN p_value::numeric >= op.value::numeric
                    WHEN '$lt' THEN p_value::numeric < op.value::numeric
                    ELSE p_value::numeric <= op.value::numeric
                END;
                IF NOT holds THEN
                    RETURN false;
                END IF;
            WHEN '$prefix' THEN
                IF jsonb_typeof(p_value) IS DISTINCT FROM 'string'
                   OR NOT starts_with(p_value #>> '{}', op.value #>> '{}') THEN
                    RETURN false;
                END IF;
            WHEN '$match' THEN
                IF jsonb_typeof(p_value) IS DISTINCT FROM 'string'
                   OR NOT fastpubsub._amqp_match(
                       string_to_array(p_value #>> '{}', '.'), string_to_array(op.value #>> '{}', '.')) THEN
                    RETURN false;
                END IF;
            ELSE
                RETURN false;  -- validation never lets an unknown operator in
        END CASE;
    END LOOP;
    RETURN true;
END
$$;

-- The one filter evaluator: every entry must hold. Field names are dotted
-- paths into the document; $and, $or and $not combine filters; $attributes
-- applies a filter to the message attributes.
CREATE FUNCTION fastpubsub._filter_eval(p_filter jsonb, p_document jsonb, p_attributes jsonb)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    e record;
    part jsonb;
    any_true boolean;
BEGIN
    IF p_filter IS NULL THEN
        RETURN true;
    END IF;
    FOR e IN SELECT key, value FROM jsonb_each(p_filter) LOOP
        CASE e.key
            WHEN '$and' THEN
                FOR part IN SELECT value FROM jsonb_array_elements(e.value) LOOP
                    IF NOT fastpubsub._filter_eval(part, p_document, p_attributes) THEN
                        RETURN false;
                    END IF;
                END LOOP;
            WHEN '$or' THEN
                any_true := false;
                FOR part IN SELECT value FROM jsonb_array_elements(e.value) LOOP
                    IF fastpubsub._filter_eval(part, p_document, p_attributes) THEN
                        any_true := true;
                        EXIT;
                    END IF;
                END LOOP;
                IF NOT any_true THEN
                    RETURN false;
                END IF;
            WHEN '$not' THEN
                IF fastpubsub._filter_eval(e.value, p_document, p_attributes) THEN
                    RETURN false;
                END IF;
            WHEN '$attributes' THEN
                IF NOT fastpubsub._filter_eval(e.value, coalesce(p_attributes, '{}'::jsonb), NULL) THEN
                    RETURN false;
                END IF;
            ELSE
                IF NOT fastpubsub._condition_matches(e.value, p_document #> string_to_array(e.key, '.')) THEN
                    RETURN false;
                END IF;
        END CASE;
    END LOOP;
    RETURN true;
END
$$;

-- Old callers (publish v1) evaluate rich filters correctly too.
CREATE OR REPLACE FUNCTION fastpubsub._filter_matches(p_filter jsonb, p_payload jsonb)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT CASE WHEN fastpubsub._filter_is_simple(p_filter)
                THEN fastpubsub._filter_matches_seed(p_filter, p_payload)
                ELSE fastpubsub._filter_eval(p_filter, p_payload, NULL) END
$$;

-- Check one filter object; raises FP422 naming the offending key.
CREATE FUNCTION fastpubsub._validate_filter_node(
    p_node jsonb, p_where text, p_depth integer, p_in_attributes boolean, INOUT p_count integer)
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    e record;
    op record;
    part jsonb;
    i integer;
    words text[];
    where_key text;
BEGIN
    IF jsonb_typeof(p_node) IS DISTINCT FROM 'object' THEN
        RAISE EXCEPTION '% must be a JSON object', p_where USING ERRCODE = 'FP422';
    END IF;
    IF p_depth > 8 THEN
        RAISE EXCEPTION 'filter is nested more than 8 levels deep at %', p_where USING ERRCODE = 'FP422';
    END IF;
    FOR e IN SELECT key, value FROM jsonb_each(p_node) LOOP
        p_count := p_count + 1;
        IF p_count > 200 THEN
            RAISE EXCEPTION 'filter has more than 200 conditions' USING ERRCODE = 'FP422';
        END IF;
        where_key := format('filter key "%s"', e.key);
        IF e.key IN ('$and', '$or') THEN
            IF jsonb_typeof(e.value) <> 'array' OR jsonb_array_length(e.value) = 0 THEN
                RAISE EXCEPTION '%: % needs a non-empty array of filters', where_key, e.key USING ERRCODE = 'FP422';
            END IF;
            i := 0;
            FOR part IN SELECT value FROM jsonb_array_elements(e.value) LOOP
                p_count := fastpubsub._validate_filter_node(
                    part, format('%s[%s]', where_key, i), p_depth + 1, p_in_attributes, p_count);
                i := i + 1;
            END LOOP;
        ELSIF e.key = '$not' THEN
            p_count := fastpubsub._validate_filter_node(e.value, where_key, p_depth + 1, p_in_attributes, p_count);
        ELSIF e.key = '$attributes' THEN
            IF p_in_attributes THEN
                RAISE EXCEPTION '%: $attributes cannot be nested', where_key USING ERRCODE = 'FP422';
            END IF;
            p_count := fastpubsub._validate_filter_node(e.value, where_key, p_depth + 1, true, p_count);
        ELSIF e.key LIKE '$%' THEN
            RAISE EXCEPTION '%: unknown operator (use $and, $or, $not, $attributes or a field name)', where_key
                USING ERRCODE = 'FP422';
        ELSE
            IF e.key = '' THEN
                RAISE EXCEPTION 'filter keys must not be empty' USING ERRCODE = 'FP422';
            END IF;
            IF length(e.key) > 256 OR e.key LIKE '.%' OR e.key LIKE '%.' OR position('..' IN e.key) > 0 THEN
                RAISE EXCEPTION '%: a field path is up to 256 characters of non-empty dot-separated names',
                    where_key USING ERRCODE = 'FP422';
            END IF;
            IF jsonb_typeof(e.value) = 'array' THEN
                IF jsonb_array_length(e.value) = 0 THEN
                    RAISE EXCEPTION '% must map to a non-empty array of allowed values or an object of operators',
                        where_key USING ERRCODE = 'FP422';
                END IF;
            ELSIF jsonb_typeof(e.value) = 'object' AND e.value <> '{}'::jsonb THEN
                FOR op IN SELECT key, value FROM jsonb_each(e.value) LOOP
                    CASE op.key
                        WHEN '$in', '$nin' THEN
                            IF jsonb_typeof(op.value) <> 'array' OR jsonb_array_length(op.value) = 0 THEN
                                RAISE EXCEPTION '%: % needs a non-empty array', where_key, op.key
                                    USING ERRCODE = 'FP422';
                            END IF;
                        WHEN '$eq', '$ne' THEN
                            NULL;  -- any JSON value
                        WHEN '$exists' THEN
                            IF jsonb_typeof(op.value) <> 'boolean' THEN
                                RAISE EXCEPTION '%: $exists needs true or false', where_key USING ERRCODE = 'FP422';
                            END IF;
                        WHEN '$gt', '$gte', '$lt', '$lte' THEN
                            IF jsonb_typeof(op.value) <> 'number' THEN
                                RAISE EXCEPTION '%: % needs a number', where_key, op.key USING ERRCODE = 'FP422';
                            END IF;
                        WHEN '$prefix' THEN
                            IF jsonb_typeof(op.value) <> 'string' THEN
                                RAISE EXCEPTION '%: $prefix needs a string', where_key USING ERRCODE = 'FP422';
                            END IF;
                        WHEN '$match' THEN
                            IF jsonb_typeof(op.value) <> 'string' OR op.value #>> '{}' = '' THEN
                                RAISE EXCEPTION '%: $match needs a pattern such as "order.*" or "payment.#"',
                                    where_key USING ERRCODE = 'FP422';
                            END IF;
                            words := string_to_array(op.value #>> '{}', '.');
                            IF EXISTS (SELECT 1 FROM unnest(words) AS w(word)
                                       WHERE w.word = '' OR (w.word <> '*' AND w.word <> '#'
                                                             AND (position('*' IN w.word) > 0
                                                                  OR position('#' IN w.word) > 0))) THEN
                                RAISE EXCEPTION '%: in $match, * and # must be whole dot-separated words',
                                    where_key USING ERRCODE = 'FP422';
                            END IF;
                        ELSE
                            RAISE EXCEPTION '%: unknown operator "%"', where_key, op.key USING ERRCODE = 'FP422';
                    END CASE;
                END LOOP;
            ELSE
                RAISE EXCEPTION '% must map to a non-empty array of allowed values or an object of operators',
                    where_key USING ERRCODE = 'FP422';
            END IF;
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION fastpubsub._validate_filter(p_filter jsonb)
RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE
AS $$
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
    PERFORM fastpubsub._validate_filter_node(p_filter, 'filter', 1, false, 0);
    RETURN p_filter;
END
$$;

-- ---------------------------------------------------------------------------
-- Publish with options
-- ---------------------------------------------------------------------------

-- What is wrong with message `p_index` of an envelope publish, or NULL.
CREATE FUNCTION fastpubsub._envelope_problem(p_message jsonb, p_index bigint)
RETURNS text
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_key text;
    v_at text;
BEGIN
    IF jsonb_typeof(p_message) <> 'object' THEN
        RETURN format('message at index %s must be an object with a "payload"', p_index);
    END IF;
    SELECT k INTO v_key FROM jsonb_object_keys(p_message) AS k
    WHERE k NOT IN ('payload', 'attributes', 'idempotency_key', 'delay_seconds', 'deliver_at', 'priority')
    LIMIT 1;
    IF v_key IS NOT NULL THEN
        RETURN format('message at index %s has an unknown field "%s"', p_index, v_key);
    END IF;
    IF jsonb_typeof(p_message -> 'payload') IS DISTINCT FROM 'object' THEN
        RETURN format('message at index %s: payload must be a JSON object', p_index);
    END IF;
    IF p_message ? 'attributes' AND jsonb_typeof(p_message -> 'attributes') <> 'null' AND (
        jsonb_typeof(p_message -> 'attributes') <> 'object'
        OR (SELECT count(*) FROM jsonb_object_keys(p_message -> 'attributes')) > 64
        OR EXISTS (SELECT 1 FROM jsonb_each(p_message -> 'attributes') AS a(k, v)
                   WHERE jsonb_typeof(a.v) <> 'string' OR length(a.k) NOT BETWEEN 1 AND 256
                      OR length(a.v #>> '{}') > 1024)) THEN
        RETURN format('message at index %s: attributes must map up to 64 names (1-256 characters) to strings '
                      '(up to 1024 characters)', p_index);
    END IF;
    IF p_message ? 'idempotency_key' AND jsonb_typeof(p_message -> 'idempotency_key') <> 'null' AND (
        jsonb_typeof(p_message -> 'idempotency_key') <> 'string'
        OR length(p_message ->> 'idempotency_key') NOT BETWEEN 1 AND 256) THEN
        RETURN format('message at index %s: idempotency_key must be a string of 1-256 characters', p_index);
    END IF;
    IF p_message ? 'priority' AND jsonb_typeof(p_message -> 'priority') <> 'null' AND (
        jsonb_typeof(p_message -> 'priority') <> 'number'
        OR (p_message ->> 'priority')::numeric NOT IN (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)) THEN
        RETURN format('message at index %s: priority must be an integer from 0 to 9', p_index);
    END IF;
    IF p_message ? 'delay_seconds' AND jsonb_typeof(p_message -> 'delay_seconds') <> 'null' AND (
        jsonb_typeof(p_message -> 'delay_seconds') <> 'number'
        OR (p_message ->> 'delay_seconds')::numeric NOT BETWEEN 0 AND 31536000) THEN
        RETURN format('message at index %s: delay_seconds must be a number from 0 to 31536000', p_index);
    END IF;
    IF p_message ? 'deliver_at' AND jsonb_typeof(p_message -> 'deliver_at') <> 'null' THEN
        IF jsonb_typeof(p_message -> 'delay_seconds') IN ('number') THEN
            RETURN format('message at index %s: give delay_seconds or deliver_at, not both', p_index);
        END IF;
        v_at := p_message ->> 'deliver_at';
        IF jsonb_typeof(p_message -> 'deliver_at') <> 'string'
           OR v_at !~ '^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}(:?\d{2})?)$' THEN
            RETURN format('message at index %s: deliver_at must be an ISO 8601 time with a time zone', p_index);
        END IF;
        BEGIN
            PERFORM v_at::timestamptz;
        EXCEPTION WHEN others THEN
            RETURN format('message at index %s: deliver_at is not a valid time', p_index);
        END;
    END IF;
    RETURN NULL;
END
$$;

-- Publish a JSON array: of payloads (p_envelopes false), or of envelopes
-- {payload, attributes, idempotency_key, delay_seconds | deliver_at, priority}.
-- All or nothing; returns message ids in input order. A repeated idempotency
-- key (in this call or an earlier one still retained) yields the original id
-- and is neither stored nor fanned out again. Delayed messages wait as
-- `scheduled` deliveries. One NOTIFY names the subscriptions fed right away.
CREATE FUNCTION fastpubsub.publish_v2(p_topic_id text, p_messages jsonb, p_envelopes boolean)
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
                    THEN (e.value ->> 'priority')::smallint ELSE 0::smallint END AS priority
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
    SELECT array_agg(DISTINCT r.subscription_id) FILTER (WHERE r.visible_at <= v_now) INTO v_woken
    FROM routes AS r;

    PERFORM fastpubsub._notify(v_woken);
    RETURN v_final;
END
$$;

-- ---------------------------------------------------------------------------
-- Consume by priority
-- ---------------------------------------------------------------------------

-- The priority just below p_below (or the highest, when NULL) that has
-- available rows: one step of a loose index scan over deliveries_ready_idx.
CREATE FUNCTION fastpubsub._next_priority(p_subscription_key integer, p_below smallint)
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

-- _advance_watermark over the priority index: the smallest live seq is the
-- smallest over the priorities present.
CREATE FUNCTION fastpubsub._advance_watermark_v2(s fastpubsub.subscriptions)
RETURNS void
LANGUAGE plpgsql
SET enable_sort = off
SET enable_bitmapscan = off
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

-- consume with priorities: due retries and delayed messages first, then the
-- highest priority, queue order within a priority. Also returns attributes
-- and priority. See consume (v1) for leasing and lease expiry.
CREATE FUNCTION fastpubsub.consume_v2(p_subscription_id text, p_consumer_id text, p_batch_size integer)
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
BEGIN
    IF p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 1000 THEN
        RAISE EXCEPTION 'batch size must be between 1 and 1000' USING ERRCODE = 'FP422';
    END IF;
    IF p_consumer_id IS NULL OR length(p_consumer_id) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'consumer id must be 1 to 200 characters' USING ERRCODE = 'FP422';
    END IF;
    v_lease_until := v_now + make_interval(secs => s.ack_deadline_seconds);

    -- 1. Retries whose backoff is over and delayed messages whose time has come.
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

    -- 2. The highest priority first; within one, oldest first among messages
    --    nobody holds, including leases that ran out (a failed attempt; dead-
    --    lettered when none is left, which does not fill the batch).
    v_priority := fastpubsub._next_priority(s.key, NULL);
    WHILE v_priority IS NOT NULL AND cardinality(v_ids) < p_batch_size LOOP
        LOOP
            WITH ready AS MATERIALIZED (
                SELECT d.ctid AS row_id, d.seq,
                       (d.lease_until IS NOT NULL AND d.attempts >= s.max_delivery_attempts) AS exhausted
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
            -- LIMIT keeps this a lookup per row (see consume).
            SELECT m.id, m.payload, m.attributes, m.priority, m.created_at FROM fastpubsub.messages AS m
            WHERE m.topic_key = s.topic_key AND m.id = x.message_id
            LIMIT 1
        ) AS m
        ORDER BY x.ord;
END
$$;

-- next_due over the priority index: each priority's in-flight rows are read
-- through an index range, never by scanning the table.
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
    RETURN greatest(extract(epoch FROM v_at - now())::double precision, 0);
END
$$;

-- ---------------------------------------------------------------------------
-- Acks wake streams
-- ---------------------------------------------------------------------------

-- A stream calls this every 30 s while it runs: acks and nacks of the
-- subscription then notify, so the stream can send more.
CREATE FUNCTION fastpubsub.touch_stream(p_subscription_id text)
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
        WHERE d.ctid = ANY (fastpubsub._held(s.key, p_ids)) AND d.lease_until IS NOT NULL
        RETURNING d.message_id, d.attempts
    )
    INSERT INTO fastpubsub.acked_deliveries (acked_at, message_id, subscription_key, attempts)
    SELECT now(), gone.message_id, s.key, gone.attempts FROM gone;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 AND s.streaming_until > now() THEN
        PERFORM fastpubsub._notify(ARRAY[s.id]);
    END IF;
    RETURN n;
END
$$;

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
        WHERE d.ctid = ANY (fastpubsub._held(s.key, p_ids)) AND d.lease_until IS NOT NULL
        RETURNING d.status
    )
    SELECT count(*), count(*) FILTER (WHERE status = 'dlq') INTO nacked, dead_lettered FROM changed;
    IF nacked > 0 AND (s.streaming_until > now() OR (nacked > dead_lettered AND s.backoff_min_seconds = 0)) THEN
        PERFORM fastpubsub._notify(ARRAY[s.id]);
    END IF;
END
$$;

-- ---------------------------------------------------------------------------
-- Subscription update and replay
-- ---------------------------------------------------------------------------

-- Change a subscription's filter (when p_set_filter) and policies (NULL keeps
-- the current value). A new filter applies to messages published afterwards.
CREATE FUNCTION fastpubsub.update_subscription(
    p_id text,
    p_set_filter boolean,
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

-- Replay: messages of the subscription published at or after p_time that are
-- still retained become deliverable again with a fresh attempt count (acked,
-- dead-lettered and leased ones included); earlier pending ones count as
-- acked. Retention is the acked-cleanup window.
CREATE FUNCTION fastpubsub.seek(p_subscription_id text, p_time timestamptz, OUT replayed integer, OUT acked integer)
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
        PERFORM fastpubsub._notify(ARRAY[s.id]);
    END IF;
END
$$;

-- Idempotency keys are kept as long as acked history (the retention window).
CREATE FUNCTION fastpubsub.cleanup_idempotency_keys(p_older_than_seconds integer, p_batch_size integer)
RETURNS integer
LANGUAGE plpgsql
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
        LIMIT p_batch_size
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;
