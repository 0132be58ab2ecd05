-- Back to revision 0013_publish_handoff: the two functions this revision's
-- upgrade gave SET enable_seqscan = off lose it, and _publish_handoff (without
-- the due column), _publish and _publish_batch are restored as revision
-- 0013_publish_handoff had them, which leaves each exactly as that revision
-- had it.

ALTER FUNCTION fastpubsub._drop_oldest(fastpubsub.subscriptions,bigint) RESET enable_seqscan;
ALTER FUNCTION fastpubsub._lease(text,text[],integer[]) RESET enable_seqscan;

DROP FUNCTION IF EXISTS fastpubsub._publish_handoff(text[], text[], boolean[], text[], text[], integer[]);

CREATE OR REPLACE FUNCTION fastpubsub._publish_handoff(
    p_topics text[], p_messages text[], p_envelopes boolean[],
    p_subscriptions text[], p_consumers text[], p_sizes integer[])
RETURNS TABLE(ids uuid[], woken text[], woken_counts integer[], events text[])
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    v_fed text[] := '{}';
BEGIN
    IF coalesce(cardinality(p_topics), 0) = 1 THEN
        SELECT p.ids, p.woken, p.woken_counts INTO ids, woken, woken_counts
        FROM fastpubsub._publish(p_topics[1], p_messages[1]::jsonb, coalesce(p_envelopes[1], false), 0) AS p;
        RETURN NEXT;
        v_fed := ARRAY(SELECT w.s FROM unnest(woken, woken_counts) AS w(s, c) WHERE w.c > 0);
    ELSE
        FOR ids, woken, woken_counts IN
            SELECT b.ids, b.woken, b.woken_counts
            FROM fastpubsub._publish_batch(p_topics, p_messages, p_envelopes) AS b
        LOOP
            RETURN NEXT;
            v_fed := v_fed || ARRAY(SELECT w.s FROM unnest(woken, woken_counts) AS w(s, c) WHERE w.c > 0);
        END LOOP;
    END IF;
    woken := NULL;
    woken_counts := NULL;
    FOR k IN 1 .. coalesce(cardinality(p_subscriptions), 0) LOOP
        ids := '{}';
        events := '{}';
        IF p_subscriptions[k] = ANY (v_fed) THEN
            BEGIN
                SELECT coalesce(array_agg(l.id ORDER BY l.ord), '{}'),
                       coalesce(array_agg(fastpubsub._message_json(
                           l.id, p_subscriptions[k], l.payload, l.attempts, l.created_at, l.attributes,
                           l.priority, l.receipt)::text ORDER BY l.ord), '{}')
                INTO ids, events
                FROM fastpubsub._lease(p_subscriptions[k], ARRAY[p_consumers[k]], ARRAY[p_sizes[k]])
                    WITH ORDINALITY AS l(slot, id, payload, attributes, priority, attempts, created_at, receipt, ord);
            EXCEPTION WHEN OTHERS THEN
                -- The publish stands: this consumer looks for itself (a lease that
                -- met a lock cycle, say, leaves nothing behind).
                RAISE WARNING 'fastpubsub: hand-off to % leased nothing: %', p_subscriptions[k], SQLERRM;
                ids := '{}';
                events := '{}';
            END;
        END IF;
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

    PERFORM fastpubsub._lock_topic(v_topic_key, false);
    PERFORM pg_current_xact_id();  -- before drawing queue numbers (see _advance_watermark)

    SELECT array_agg(fastpubsub._message_id(v_now, p_offset + e.ord - 1) ORDER BY e.ord),
           array_agg(CASE WHEN p_envelopes THEN e.value ->> 'idempotency_key' END ORDER BY e.ord),
           bool_or(p_envelopes AND (e.value ? 'ttl_seconds' OR e.value ? 'expires_at'))
    INTO v_ids, v_keys, v_expiring
    FROM jsonb_array_elements(p_messages) WITH ORDINALITY AS e(value, ord);
    ids := v_ids;
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
    PERFORM fastpubsub._notify(woken, woken_counts);
END
$$;

CREATE OR REPLACE FUNCTION fastpubsub._publish_batch(p_topics text[], p_messages text[], p_envelopes boolean[])
RETURNS TABLE(ids uuid[], woken text[], woken_counts integer[])
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET jit = off
AS $$
DECLARE
    n integer := coalesce(cardinality(p_topics), 0);
    v_bodies jsonb[] := '{}';
    -- Request i's ids are v_ids[v_first[i] : v_first[i] + v_count[i] - 1]; the
    -- same for what a group's first request reports woken.
    v_ids uuid[] := '{}';
    v_first integer[] := array_fill(1, ARRAY[n]);
    v_count integer[] := array_fill(0, ARRAY[n]);
    v_woken text[] := '{}';
    v_woken_counts integer[] := '{}';
    v_woken_first integer[] := array_fill(1, ARRAY[n]);
    v_woken_count integer[] := array_fill(0, ARRAY[n]);
    v_published record;
    g record;
    v_member integer;
    v_at integer;
BEGIN
    FOR i IN 1 .. n LOOP
        v_bodies := v_bodies || p_messages[i]::jsonb;
    END LOOP;
    IF n > 1 THEN
        -- Publishers of subscriptions with a backlog limit are serialised
        -- (_make_room): take those locks for every topic of the batch first, in
        -- key order, so that two batches never wait for each other in a cycle.
        PERFORM pg_advisory_xact_lock(1718645603, x.key)
        FROM (SELECT s.key FROM fastpubsub.topics AS t
              JOIN fastpubsub.subscriptions AS s ON s.topic_key = t.key AND s.max_backlog IS NOT NULL
              WHERE t.id = ANY (p_topics) AND t.backlog_limited
              ORDER BY s.key) AS x;
    END IF;
    FOR g IN
        SELECT x.topic, bool_or(coalesce(x.envelopes, false)) AS envelopes,
               array_agg(x.ord::integer ORDER BY x.ord) AS members,
               array_agg(coalesce(x.envelopes, false) ORDER BY x.ord) AS kinds
        FROM unnest(p_topics, p_envelopes, v_bodies) WITH ORDINALITY AS x(topic, envelopes, body, ord)
        LEFT JOIN fastpubsub.topics AS t ON t.id = x.topic
        GROUP BY x.topic,
                 -- a body _publish refuses is published alone, to fail with its own error;
                 -- so is each request to a topic with backlog limits, which apply
                 -- request by request, in order (a merged group could be refused
                 -- as a whole, or make room differently)
                 CASE WHEN jsonb_typeof(x.body) = 'array' AND jsonb_array_length(x.body) > 0
                           AND NOT coalesce(t.backlog_limited, false) THEN 0
                      ELSE x.ord END
        ORDER BY min(x.ord)
    LOOP
        v_published := fastpubsub._publish(
            g.topic,
            CASE WHEN cardinality(g.members) = 1 THEN v_bodies[g.members[1]]
                 ELSE (SELECT jsonb_agg(CASE WHEN g.envelopes AND NOT g.kinds[m.ord::integer]
                                             THEN jsonb_build_object('payload', e.value)  -- the same message
                                             ELSE e.value END
                                        ORDER BY m.ord, e.ord)
                       FROM unnest(g.members) WITH ORDINALITY AS m(member, ord)
                       CROSS JOIN LATERAL jsonb_array_elements(v_bodies[m.member]) WITH ORDINALITY AS e(value, ord))
            END,
            g.envelopes,
            cardinality(v_ids));
        v_at := cardinality(v_ids) + 1;
        FOREACH v_member IN ARRAY g.members LOOP
            v_first[v_member] := v_at;
            v_count[v_member] := jsonb_array_length(v_bodies[v_member]);
            v_at := v_at + v_count[v_member];
        END LOOP;
        v_ids := v_ids || v_published.ids;
        v_woken_first[g.members[1]] := cardinality(v_woken) + 1;
        v_woken_count[g.members[1]] := cardinality(v_published.woken);
        v_woken := v_woken || v_published.woken;
        v_woken_counts := v_woken_counts || v_published.woken_counts;
    END LOOP;
    FOR i IN 1 .. n LOOP
        ids := v_ids[v_first[i] : v_first[i] + v_count[i] - 1];
        woken := v_woken[v_woken_first[i] : v_woken_first[i] + v_woken_count[i] - 1];
        woken_counts := v_woken_counts[v_woken_first[i] : v_woken_first[i] + v_woken_count[i] - 1];
        RETURN NEXT;
    END LOOP;
END
$$;
