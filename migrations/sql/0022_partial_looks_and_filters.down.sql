-- Back to revision 0021_reprocess_within_backlog: _consume_batch (next_due
-- only for a request that leased nothing), _publish and _make_room (seed
-- filters through _filter_matches_seed) as that revision had them.

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
        IF EXISTS (SELECT 1 FROM unnest(g.members) AS m(member) WHERE v_leased[m.member] = 0) THEN
            v_next_due := fastpubsub.next_due(g.subscription);
            FOREACH v_member IN ARRAY g.members LOOP
                IF v_leased[v_member] = 0 THEN
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
                        THEN v_now + make_interval(secs => round((e.value ->> 'delay_seconds')::numeric, 6)::float8)
                    ELSE v_now END AS visible_at,
               CASE WHEN p_envelopes AND jsonb_typeof(e.value -> 'priority') = 'number'
                    THEN (e.value ->> 'priority')::numeric::smallint ELSE 0::smallint END AS priority,
               CASE WHEN NOT v_expiring THEN NULL
                    WHEN jsonb_typeof(e.value -> 'expires_at') = 'string' THEN (e.value ->> 'expires_at')::timestamptz
                    WHEN jsonb_typeof(e.value -> 'ttl_seconds') = 'number'
                        THEN v_now + make_interval(secs => round((e.value ->> 'ttl_seconds')::numeric, 6)::float8)
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
            -- What the backlog held before this publish (nothing of it is dropped
            -- in the end: the publish fails as a whole).
            RAISE EXCEPTION 'subscription "%" is full: % messages in its backlog, max_backlog %, % more published%; '
                            'nothing was published', s.id, v_backlog, s.max_backlog, r.n,
                            CASE WHEN s.backlog_policy = 'drop_oldest'
                                 THEN format(', and only %s could be dropped (leased ones never are)', v_dropped)
                                 ELSE '' END
                USING ERRCODE = 'FP429', DETAIL = s.id;
        END IF;
        PERFORM fastpubsub._count(r.key, r.n - v_dropped, 0, v_dropped);
    END LOOP;
END
$$;
