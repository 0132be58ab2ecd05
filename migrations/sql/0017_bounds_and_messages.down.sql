-- Back to revision 0016_grouped_acks: _message_id_floor, _make_room and
-- _validate_filter_node as that revision had them (a time before 1970 gave the
-- largest id bound, a publish refused for want of room said the backlog held
-- what would have been left after the drops, and an empty word in a $match
-- pattern was refused as a misplaced * or #).

CREATE OR REPLACE FUNCTION fastpubsub._message_id_floor(p_time timestamptz)
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

CREATE OR REPLACE FUNCTION fastpubsub._make_room(
    p_topic_key integer, p_messages jsonb, p_envelopes boolean, p_store boolean[])
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    r record;
    s fastpubsub.subscriptions;
    v_backlog bigint;
    v_excess bigint;
    v_dropped bigint;
BEGIN
    FOR r IN
        SELECT x.key, count(*) AS n
        FROM (SELECT CASE WHEN p_envelopes THEN e.value -> 'payload' ELSE e.value END AS payload,
                     CASE WHEN p_envelopes THEN nullif(nullif(e.value -> 'attributes', 'null'::jsonb), '{}'::jsonb)
                     END AS attributes
              FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS e(value, ord)
              WHERE p_store[e.ord]) AS i
        JOIN fastpubsub.subscriptions AS x
          ON x.topic_key = p_topic_key AND x.max_backlog IS NOT NULL
         AND (x.filter IS NULL
              OR CASE WHEN x.filter_simple THEN fastpubsub._filter_matches_seed(x.filter, i.payload)
                      ELSE fastpubsub._filter_eval(x.filter, i.payload, i.attributes) END)
        GROUP BY x.key
        ORDER BY x.key
    LOOP
        PERFORM pg_advisory_xact_lock(1718645603, r.key);
        SELECT * INTO s FROM fastpubsub.subscriptions WHERE key = r.key;
        SELECT coalesce(max(c.backlog), 0) INTO v_backlog
        FROM fastpubsub.subscription_counts AS c WHERE c.subscription_key = r.key;
        v_excess := v_backlog + r.n - s.max_backlog;
        v_dropped := 0;
        IF v_excess > 0 AND s.backlog_policy = 'drop_oldest' THEN
            v_dropped := fastpubsub._drop_oldest(s, v_excess);
        END IF;
        IF v_excess > v_dropped THEN
            RAISE EXCEPTION 'subscription "%" is full: % messages in its backlog, max_backlog %, % more published; '
                            'nothing was published', s.id, v_backlog - v_dropped, s.max_backlog, r.n
                USING ERRCODE = 'FP429', DETAIL = s.id;
        END IF;
        PERFORM fastpubsub._count(r.key, r.n - v_dropped, 0, v_dropped);
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION fastpubsub._validate_filter_node(p_node jsonb, p_where text, p_depth integer, p_in_attributes boolean, INOUT p_count integer)
RETURNS integer
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
