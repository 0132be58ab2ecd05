-- Publishing: the entry points applications may call inside their own
-- transactions (publish, publish_envelopes), the one implementation behind
-- them, and the batch the server commits several requests with.

-- What is wrong with one envelope (NULL: nothing), naming its index.
CREATE OR REPLACE FUNCTION fastpubsub._envelope_problem(p_message jsonb, p_index bigint)
RETURNS text
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_key text;
    v_at text;
    v_pair text[];
BEGIN
    IF jsonb_typeof(p_message) <> 'object' THEN
        RETURN format('message at index %s must be an object with a "payload"', p_index);
    END IF;
    SELECT k INTO v_key FROM jsonb_object_keys(p_message) AS k
    WHERE k NOT IN ('payload', 'attributes', 'idempotency_key', 'delay_seconds', 'deliver_at', 'priority',
                    'ttl_seconds', 'expires_at')
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
    IF p_message ? 'ttl_seconds' AND jsonb_typeof(p_message -> 'ttl_seconds') <> 'null' AND (
        jsonb_typeof(p_message -> 'ttl_seconds') <> 'number'
        OR (p_message ->> 'ttl_seconds')::numeric <= 0 OR (p_message ->> 'ttl_seconds')::numeric > 315360000) THEN
        RETURN format('message at index %s: ttl_seconds must be a number above 0 and up to 315360000', p_index);
    END IF;
    -- A time given instead of a number of seconds from now: one or the other.
    FOREACH v_pair SLICE 1 IN ARRAY ARRAY[['delay_seconds', 'deliver_at'], ['ttl_seconds', 'expires_at']] LOOP
        CONTINUE WHEN NOT p_message ? v_pair[2] OR jsonb_typeof(p_message -> v_pair[2]) = 'null';
        IF jsonb_typeof(p_message -> v_pair[1]) IN ('number') THEN
            RETURN format('message at index %s: give %s or %s, not both', p_index, v_pair[1], v_pair[2]);
        END IF;
        v_at := p_message ->> v_pair[2];
        IF jsonb_typeof(p_message -> v_pair[2]) <> 'string'
           OR v_at !~ '^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}(:?\d{2})?)$' THEN
            RETURN format('message at index %s: %s must be an ISO 8601 time with a time zone', p_index, v_pair[2]);
        END IF;
        BEGIN
            PERFORM v_at::timestamptz;
        EXCEPTION WHEN others THEN
            RETURN format('message at index %s: %s is not a valid time', p_index, v_pair[2]);
        END;
    END LOOP;
    RETURN NULL;
END
$$;

-- Publish: store every message once and fan it out to each subscription of the
-- topic whose filter accepts it, all in this transaction, or nothing at all.
-- p_envelopes: each element is {payload, attributes, idempotency_key,
-- delay_seconds | deliver_at, priority, ttl_seconds | expires_at}; otherwise
-- each element is a payload. On a topic with a backlog limit, _make_room
-- applies the limits first (FP429 refuses the whole publish).
-- p_offset shifts the time steps of the ids, so that several publishes in one
-- transaction keep their order by id (see _publish_batch).
-- Returns the message ids in order (a repeated idempotency key gives the
-- original id and stores nothing new), and the subscriptions the messages
-- were routed to with how many are deliverable now (0: delayed ones only).
-- Those subscriptions are notified (_notify) unless the session said not to.
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
              OR CASE WHEN s.filter_simple  -- _filter_matches_seed, written out (filters.sql)
                      THEN NOT EXISTS (
                          SELECT 1 FROM jsonb_each(s.filter) AS f(key, allowed)
                          WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements(f.allowed) AS a(value)
                                            WHERE a.value = i.payload -> f.key))
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

-- Room for a publish on a topic with backlog limits, before anything is
-- stored: for each subscription with a max_backlog that the messages to store
-- (p_store) are routed to, in key order, its publishers are serialised (an
-- advisory lock until commit) and its counted backlog plus the new messages
-- is compared with the limit. Over it, backlog_policy reject raises FP429
-- naming the subscription (the transaction, and so the whole publish, fails);
-- drop_oldest drops as many waiting messages as it takes (FP429 when not
-- enough are waiting: leased ones are never dropped). The new messages are
-- counted in the backlog.
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
              OR CASE WHEN x.filter_simple  -- _filter_matches_seed, written out (filters.sql)
                      THEN NOT EXISTS (
                          SELECT 1 FROM jsonb_each(x.filter) AS f(key, allowed)
                          WHERE NOT EXISTS (SELECT 1 FROM jsonb_array_elements(f.allowed) AS a(value)
                                            WHERE a.value = i.payload -> f.key))
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

-- Drop up to p_count waiting messages of a subscription to make room: the
-- lowest priority first and queue order within one, then delayed ones, soonest
-- due first; never one leased now. Their messages go once nothing else refers
-- to them. Returns how many were dropped. Rows go by their address, never by
-- reading the table (as in _lease).
CREATE OR REPLACE FUNCTION fastpubsub._drop_oldest(s fastpubsub.subscriptions, p_count bigint)
RETURNS bigint
LANGUAGE plpgsql
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    v_now timestamptz := now();
    v_priorities smallint[] := '{}';
    v_priority smallint;
    v_ids uuid[] := '{}';
    v_more uuid[];
BEGIN
    v_priority := fastpubsub._next_priority(s.key, NULL);
    WHILE v_priority IS NOT NULL LOOP
        v_priorities := v_priority || v_priorities;  -- lowest first
        v_priority := fastpubsub._next_priority(s.key, v_priority);
    END LOOP;
    FOREACH v_priority IN ARRAY v_priorities LOOP
        EXIT WHEN cardinality(v_ids) >= p_count;
        WITH gone AS (
            DELETE FROM fastpubsub.deliveries AS d
            WHERE d.ctid = ANY (ARRAY(
                SELECT x.ctid FROM fastpubsub.deliveries AS x
                WHERE x.subscription_key = s.key AND x.status = 'available' AND x.priority = v_priority
                  AND x.seq >= s.consume_from AND (x.lease_until IS NULL OR x.lease_until <= v_now)
                ORDER BY x.seq
                LIMIT p_count - cardinality(v_ids)
                FOR UPDATE SKIP LOCKED))
            RETURNING d.message_id
        )
        SELECT coalesce(array_agg(message_id), '{}') INTO v_more FROM gone;
        v_ids := v_ids || v_more;
    END LOOP;
    IF cardinality(v_ids) < p_count THEN
        WITH gone AS (
            DELETE FROM fastpubsub.deliveries AS d
            WHERE d.ctid = ANY (ARRAY(
                SELECT x.ctid FROM fastpubsub.deliveries AS x
                WHERE x.subscription_key = s.key AND x.status = 'scheduled'
                ORDER BY x.visible_at
                LIMIT p_count - cardinality(v_ids)
                FOR UPDATE SKIP LOCKED))
            RETURNING d.message_id
        )
        SELECT v_ids || coalesce(array_agg(message_id), '{}') INTO v_ids FROM gone;
    END IF;
    PERFORM fastpubsub._delete_orphan_messages(array_fill(s.topic_key, ARRAY[cardinality(v_ids)]), v_ids);
    RETURN cardinality(v_ids);
END
$$;

-- Several publishes in one transaction (group commit): request i publishes
-- p_messages[i] (JSON text) to p_topics[i], as envelopes when p_envelopes[i],
-- as _publish does, in order; one row per request in the same order. Either
-- all of them are committed or none is: a caller that gets an error retries
-- the requests one at a time to find whose it was.
--
-- The requests for one topic are written by one _publish over all their
-- messages, in request order (payloads become envelopes {"payload": ...}
-- when envelopes are among them: the same messages), which is what makes many
-- one-message requests cheap. Each request gets its own slice of the ids
-- (within a topic, ids grow in request order); the subscriptions fed, with
-- their counts for all of them, come with the group's first request (the
-- others' are empty). A body that is not a non-empty JSON array is published
-- alone, so it fails with its own error; so is each request to a topic with
-- backlog limits (topics.backlog_limited), so that a refused one (FP429) is
-- refused for its own messages, as when it comes alone.
--
-- The usual batch, every request of one kind to one topic without backlog
-- limits, is one group: it is written by one statement that gathers the
-- messages and one that deals out the ids, without the grouping's bookkeeping
-- (a fifth of such a batch's time in PostgreSQL). A bad body among them
-- fails the batch as the grouping would (the caller then retries each alone).
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
    v_counts integer[];
    v_body jsonb;
BEGIN
    IF n > 1 AND cardinality(p_messages) = n AND cardinality(p_envelopes) = n
       AND p_topics[1] = ALL (p_topics)
       AND cardinality(array_remove(array_replace(p_envelopes, NULL, false), coalesce(p_envelopes[1], false))) = 0
       AND NOT EXISTS (SELECT FROM fastpubsub.topics AS t WHERE t.id = p_topics[1] AND t.backlog_limited) THEN
        WITH b AS (
            SELECT m.ord, CASE WHEN jsonb_typeof(m.body) = 'array' THEN m.body END AS body
            FROM unnest(CAST(p_messages AS jsonb[])) WITH ORDINALITY AS m(body, ord)
        )
        SELECT (SELECT array_agg(jsonb_array_length(b.body) ORDER BY b.ord) FROM b),
               (SELECT jsonb_agg(e.value ORDER BY b.ord, e.ord)
                FROM b CROSS JOIN LATERAL jsonb_array_elements(b.body) WITH ORDINALITY AS e(value, ord))
        INTO v_counts, v_body;
        IF array_position(v_counts, NULL) IS NOT NULL OR array_position(v_counts, 0) IS NOT NULL THEN
            RAISE EXCEPTION 'messages must be a non-empty JSON array' USING ERRCODE = 'FP422';
        END IF;
        v_published := fastpubsub._publish(p_topics[1], v_body, coalesce(p_envelopes[1], false), 0);
        RETURN QUERY
        SELECT v_published.ids[c.upto - c.count + 1 : c.upto],
               CASE WHEN c.ord = 1 THEN coalesce(v_published.woken, '{}') ELSE '{}' END,
               CASE WHEN c.ord = 1 THEN coalesce(v_published.woken_counts, '{}') ELSE '{}' END
        FROM (SELECT u.count, u.ord, CAST(sum(u.count) OVER (ORDER BY u.ord) AS integer) AS upto
              FROM unnest(v_counts) WITH ORDINALITY AS u(count, ord)) AS c
        ORDER BY c.ord;
        RETURN;
    END IF;
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

-- Publish (a group commit's requests as _publish_batch does, one alone as
-- _publish) and, in the same transaction, lease the messages it made
-- deliverable to consumers waiting for them in the publishing server process:
-- up to p_sizes[k] messages of p_subscriptions[k] to p_consumers[k] (_lease:
-- the oldest deliverable first, as their own look would take them), for each
-- k whose subscription this publish fed messages deliverable now; the others
-- lease nothing, and so does one whose lease fails (the publish stands). Such
-- a consumer answers with these at once, without a transaction of its own,
-- and they are committed with the publish or not at all. Rows: each publish request's (ids, woken, woken_counts), in order;
-- then for each k, in order, the ids it leased and each message's JSON as
-- consume renders it (events), and, when it leased fewer than p_sizes[k] (all
-- there was), next_due of the subscription (due), as a look that took all
-- there was reports it.
CREATE OR REPLACE FUNCTION fastpubsub._publish_handoff(
    p_topics text[], p_messages text[], p_envelopes boolean[],
    p_subscriptions text[], p_consumers text[], p_sizes integer[])
RETURNS TABLE(ids uuid[], woken text[], woken_counts integer[], events text[], due double precision)
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
        due := NULL;
        IF p_subscriptions[k] = ANY (v_fed) THEN
            BEGIN
                SELECT coalesce(array_agg(l.id ORDER BY l.ord), '{}'),
                       coalesce(array_agg(fastpubsub._message_json(
                           l.id, p_subscriptions[k], l.payload, l.attempts, l.created_at, l.attributes,
                           l.priority, l.receipt)::text ORDER BY l.ord), '{}')
                INTO ids, events
                FROM fastpubsub._lease(p_subscriptions[k], ARRAY[p_consumers[k]], ARRAY[p_sizes[k]])
                    WITH ORDINALITY AS l(slot, id, payload, attributes, priority, attempts, created_at, receipt, ord);
                IF cardinality(ids) < p_sizes[k] THEN
                    -- It took all there was: what falls due next (a delayed
                    -- message of this publish, say) is for its timer, as after a look.
                    due := fastpubsub.next_due(p_subscriptions[k]);
                END IF;
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

-- Where the ids of the next publish in this transaction start (_publish's
-- p_offset), past those of the publishes made in it so far: the publishes of
-- one transaction share its time (now()), and ids order them in publish order
-- only if each takes time steps of its own. The count is kept until the
-- transaction ends (a transaction-local setting).
CREATE OR REPLACE FUNCTION fastpubsub._transaction_offset(p_messages jsonb)
RETURNS bigint
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    v_offset bigint := coalesce(nullif(current_setting('fastpubsub.publish_offset', true), '')::bigint, 0);
BEGIN
    PERFORM set_config('fastpubsub.publish_offset',
                       (v_offset + CASE WHEN jsonb_typeof(p_messages) = 'array'
                                        THEN jsonb_array_length(p_messages) ELSE 0 END)::text,
                       true);
    RETURN v_offset;
END
$$;

-- Publish payloads (each a JSON object): the seed's request body.
CREATE OR REPLACE FUNCTION fastpubsub.publish(p_topic_id text, p_payloads jsonb)
RETURNS uuid[]
LANGUAGE sql VOLATILE
AS $$
    SELECT (fastpubsub._publish(p_topic_id, p_payloads, false, fastpubsub._transaction_offset(p_payloads))).ids
$$;

-- Publish envelopes with options:
--   [{"payload": {...}, "attributes": {"k": "v"}, "idempotency_key": "...",
--     "delay_seconds": 10 | "deliver_at": "2030-01-01T00:00:00Z", "priority": 0-9,
--     "ttl_seconds": 60 | "expires_at": "2030-01-01T00:00:00Z"}]
CREATE OR REPLACE FUNCTION fastpubsub.publish_envelopes(p_topic_id text, p_envelopes jsonb)
RETURNS uuid[]
LANGUAGE sql VOLATILE
AS $$
    SELECT (fastpubsub._publish(p_topic_id, p_envelopes, true, fastpubsub._transaction_offset(p_envelopes))).ids
$$;
