-- Filters: which published messages a subscription receives.
--
-- A filter is a JSON object. The seed format maps top-level field names to
-- lists of allowed values (every field present, with one of its values,
-- compared as JSON). Beyond it, field names are dotted paths, a field may map
-- to operators, and $and, $or, $not and $attributes combine filters
-- (docs/filters.md). Filters are validated when a subscription is created or
-- changed, and evaluated by publish: _filter_matches_seed for the seed format,
-- _filter_eval for everything else.

-- The seed semantics. Publish (_publish, _make_room) writes this expression
-- out where it filters: PostgreSQL inlines no SQL function whose body holds a
-- subquery, and before version 18 it plans such a function again for every
-- statement that calls it (on PostgreSQL 15, a one-message publish to a topic
-- with a seed-filtered subscription took 110 µs more than one without; written
-- out, 10-30 µs more, on 15 and on 18).
CREATE OR REPLACE FUNCTION fastpubsub._filter_matches_seed(p_filter jsonb, p_payload jsonb)
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

-- One field condition against the value found at its path (NULL when absent):
-- a list of allowed values, or an object of operators that must all hold.
CREATE OR REPLACE FUNCTION fastpubsub._condition_matches(p_condition jsonb, p_value jsonb)
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

-- The one evaluator of rich filters: every entry must hold. Field names are
-- dotted paths into the document; $and, $or and $not combine filters;
-- $attributes applies a filter to the message attributes.
CREATE OR REPLACE FUNCTION fastpubsub._filter_eval(p_filter jsonb, p_document jsonb, p_attributes jsonb)
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

-- Check one filter object (and what it nests), counting conditions; raises
-- FP422 naming the offending key.
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
                            IF '' = ANY (words) THEN
                                RAISE EXCEPTION '%: a $match pattern has no empty words (a dot at either end, '
                                                'or two in a row)', where_key USING ERRCODE = 'FP422';
                            END IF;
                            IF EXISTS (SELECT 1 FROM unnest(words) AS w(word)
                                       WHERE w.word <> '*' AND w.word <> '#'
                                         AND (position('*' IN w.word) > 0 OR position('#' IN w.word) > 0)) THEN
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

-- The filter to store for p_filter ({} and null are stored as NULL: no
-- filtering), or FP422 naming the offending key.
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
