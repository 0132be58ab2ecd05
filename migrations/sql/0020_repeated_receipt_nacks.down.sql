-- Back to revision 0019_repeated_receipt_acks: the functions as that
-- revision had them (a nack clears the row's leased_at, and a repeated
-- receipt nack answers 'lease not held'), then no row that holds no lease
-- keeps a lease time, as under that revision.

CREATE OR REPLACE FUNCTION fastpubsub._nack_rows(
    s fastpubsub.subscriptions, p_rows tid[], p_requeue boolean,
    OUT done uuid[], OUT dead uuid[], OUT ready integer)
RETURNS record
LANGUAGE plpgsql
AS $$
BEGIN
    WITH changed AS (
        UPDATE fastpubsub.deliveries AS d
        SET status = CASE WHEN d.attempts >= s.max_delivery_attempts OR NOT p_requeue
                          THEN 'dlq' ELSE 'scheduled' END::fastpubsub.delivery_status,
            visible_at = CASE WHEN d.attempts >= s.max_delivery_attempts OR NOT p_requeue THEN now()
                              ELSE now() + make_interval(secs => fastpubsub._retry_delay(s, d.attempts))
                         END,
            lease_until = NULL,
            leased_at = NULL,
            consumer_id = NULL
        WHERE d.ctid = ANY (p_rows) AND d.lease_until > now()
        RETURNING d.message_id, d.status, d.visible_at
    )
    SELECT coalesce(array_agg(c.message_id), '{}'),
           coalesce(array_agg(c.message_id) FILTER (WHERE c.status = 'dlq'), '{}'),
           count(*) FILTER (WHERE c.status = 'scheduled' AND c.visible_at <= now())
    INTO done, dead, ready
    FROM changed AS c;
    IF cardinality(done) > 0 THEN
        PERFORM fastpubsub._notify(
            array_remove(ARRAY[CASE WHEN cardinality(done) > cardinality(dead) THEN s.id END,
                               CASE WHEN s.streaming_until > now() THEN 'settled:' || s.id END], NULL),
            array_remove(ARRAY[CASE WHEN cardinality(done) > cardinality(dead) THEN ready END,
                               CASE WHEN s.streaming_until > now() THEN cardinality(done) END], NULL));
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION fastpubsub._settle_batch(p_requests jsonb)
RETURNS TABLE(result jsonb)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    n integer := coalesce(jsonb_array_length(p_requests), 0);
    v_results jsonb[] := array_fill(NULL::jsonb, ARRAY[n]);
    g record;
    r record;
    s fastpubsub.subscriptions;
    v_items text[];
    v_members integer[];
    v_rows tid[];
    v_matched bigint[];
    v_done uuid[];
    v_dead uuid[];
    v_done_set jsonb;
    v_dead_set jsonb;
    v_matched_set jsonb;
    v_ready integer;
    v_nacked record;
    v_member integer;
    v_counted integer[] := '{}';
    v_left bigint[] := '{}';
    v_acked bigint[];
    v_streaming boolean;
BEGIN
    FOR g IN
        SELECT x.request ->> 'subscription' AS subscription, x.request ->> 'action' AS action,
               coalesce((x.request ->> 'requeue')::boolean, true) AS requeue,
               (x.request ->> 'seconds')::integer AS seconds,
               x.request ? 'receipts' AS by_receipt,
               array_agg(x.ord::integer ORDER BY x.ord) AS members
        FROM jsonb_array_elements(p_requests) WITH ORDINALITY AS x(request, ord)
        GROUP BY 1, 2, 3, 4, 5
        ORDER BY min(x.ord)
    LOOP
        s := fastpubsub._subscription(g.subscription);
        v_streaming := coalesce(s.streaming_until > now(), false);
        -- Every id or receipt of the group, in request order, and whose it is.
        SELECT coalesce(array_agg(e.item ORDER BY m.ord, e.pos), '{}'),
               coalesce(array_agg(m.member ORDER BY m.ord, e.pos), '{}')
        INTO v_items, v_members
        FROM unnest(g.members) WITH ORDINALITY AS m(member, ord)
        CROSS JOIN LATERAL jsonb_array_elements_text(
            p_requests -> (m.member - 1) -> CASE WHEN g.by_receipt THEN 'receipts' ELSE 'ids' END)
            WITH ORDINALITY AS e(item, pos);
        IF g.by_receipt THEN
            SELECT coalesce(array_agg(h.row_id), '{}'), coalesce(array_agg(h.pos), '{}')
            INTO v_rows, v_matched
            FROM fastpubsub._held_receipts(s.key, v_items) AS h;
        ELSE
            v_rows := fastpubsub._held(s.key, v_items::uuid[]);
        END IF;
        v_dead := '{}';
        v_ready := 0;
        IF g.action = 'ack' THEN
            v_done := fastpubsub._ack_rows(s, v_rows);
        ELSIF g.action = 'nack' THEN
            v_nacked := fastpubsub._nack_rows(s, v_rows, g.requeue);
            v_done := v_nacked.done;
            v_dead := v_nacked.dead;
            v_ready := v_nacked.ready;
        ELSIF g.action = 'extend' THEN
            v_done := fastpubsub._extend_rows(s, v_rows, g.seconds);
            IF g.seconds = 0 THEN
                v_ready := cardinality(v_done);
            END IF;
        ELSE
            RAISE EXCEPTION 'unknown settlement "%"', g.action USING ERRCODE = 'FP422';
        END IF;
        IF s.max_backlog IS NOT NULL AND g.action <> 'extend' THEN
            -- acked and dead-lettered messages leave the backlog
            v_counted := v_counted || s.key;
            v_left := v_left || -cardinality(CASE WHEN g.action = 'ack' THEN v_done ELSE v_dead END)::bigint;
        END IF;
        IF g.action = 'ack' AND NOT g.by_receipt THEN
            -- The usual groups, requests acking by id: each message acked
            -- counts once (_ack_rows deletes a row once, however often its id
            -- came), for the first request of the group that names it; none is
            -- dead-lettered and there are no outcomes. That is what the
            -- bookkeeping below finds for them, at a fraction of the cost.
            v_acked := array_fill(0::bigint, ARRAY[n]);  -- how many each request acked
            IF cardinality(g.members) = 1 THEN
                v_acked[g.members[1]] := cardinality(v_done);
            ELSE
                v_done_set := coalesce((SELECT jsonb_object_agg(d, true) FROM unnest(v_done) AS d), '{}');
                FOR r IN
                    SELECT f.member, count(*) AS done
                    FROM (SELECT DISTINCT ON (e.id) e.id, e.member
                          FROM unnest(v_members, v_items::uuid[]) AS e(member, id)
                          ORDER BY e.id, e.member) AS f
                    WHERE v_done_set ? f.id::text
                    GROUP BY f.member
                LOOP
                    v_acked[r.member] := r.done;
                END LOOP;
            END IF;
            FOREACH v_member IN ARRAY g.members LOOP
                v_results[v_member] := jsonb_build_object(
                    'done', v_acked[v_member], 'dead', 0, 'outcomes', NULL, 'ready', 0, 'streaming', v_streaming);
            END LOOP;
            CONTINUE;
        END IF;
        -- Sets to look items up in (jsonb objects: each lookup a binary search,
        -- where scanning the arrays would cost the group's size squared).
        v_done_set := coalesce((SELECT jsonb_object_agg(d, true) FROM unnest(v_done) AS d), '{}');
        v_dead_set := coalesce((SELECT jsonb_object_agg(d, true) FROM unnest(v_dead) AS d), '{}');
        v_matched_set := coalesce((SELECT jsonb_object_agg(m, true) FROM unnest(v_matched) AS m), '{}');
        FOR r IN
            WITH items AS (
                SELECT e.member, e.pos, e.item,
                       CASE WHEN g.by_receipt THEN l.message_id ELSE e.item::uuid END AS message_id,
                       l.leased_micros,
                       -- (an id by its value: the same message spelt in capitals or without
                       -- hyphens is still named twice)
                       min(e.member) OVER (PARTITION BY CASE WHEN g.by_receipt THEN e.item
                                                             ELSE e.item::uuid::text END) AS first_member
                FROM unnest(v_members, v_items) WITH ORDINALITY AS e(member, item, pos)
                CROSS JOIN LATERAL fastpubsub._receipt_lease(CASE WHEN g.by_receipt THEN e.item END) AS l
            ), settled AS (
                SELECT i.member, i.pos, i.message_id, i.leased_micros,
                       i.member = i.first_member AND v_done_set ? i.message_id::text
                       AND (NOT g.by_receipt OR v_matched_set ? i.pos::text) AS here,
                       v_dead_set ? i.message_id::text AS dead
                FROM items AS i
            )
            SELECT t.member,
                   count(DISTINCT t.message_id) FILTER (WHERE t.here) AS done,
                   count(DISTINCT t.message_id) FILTER (WHERE t.here AND t.dead) AS dead,
                   CASE WHEN g.by_receipt THEN
                       jsonb_agg(CASE WHEN t.message_id IS NULL THEN 'invalid receipt'
                                      WHEN t.here AND t.dead THEN 'dead_lettered'
                                      WHEN t.here THEN CASE g.action WHEN 'ack' THEN 'acknowledged'
                                                                     WHEN 'nack' THEN 'nacked' ELSE 'extended' END
                                      -- an ack of this very lease landed before (its answer
                                      -- was lost, say): acknowledged again, counted once
                                      WHEN g.action = 'ack' AND EXISTS (
                                          SELECT 1 FROM fastpubsub.acked_deliveries AS a
                                          WHERE a.subscription_key = s.key AND a.message_id = t.message_id
                                            AND fastpubsub._micros(a.leased_at) = t.leased_micros)
                                          THEN 'acknowledged'
                                      ELSE 'lease not held' END ORDER BY t.pos)
                   END AS outcomes
            FROM settled AS t
            GROUP BY t.member
        LOOP
            v_results[r.member] := jsonb_build_object('done', r.done, 'dead', r.dead, 'outcomes', r.outcomes);
        END LOOP;
        FOREACH v_member IN ARRAY g.members LOOP
            v_results[v_member] := coalesce(v_results[v_member], '{"done": 0, "dead": 0, "outcomes": null}')
                || jsonb_build_object('ready', CASE WHEN v_member = g.members[1] THEN v_ready ELSE 0 END,
                                      'streaming', v_streaming);
        END LOOP;
    END LOOP;
    FOR i IN 1 .. n LOOP
        result := v_results[i];
        RETURN NEXT;
    END LOOP;
    IF cardinality(v_counted) > 0 THEN
        PERFORM fastpubsub._count_all(v_counted, v_left, array_fill(0::bigint, ARRAY[cardinality(v_counted)]),
                                      array_fill(0::bigint, ARRAY[cardinality(v_counted)]));
    END IF;
END
$$;

UPDATE fastpubsub.deliveries SET leased_at = NULL WHERE lease_until IS NULL AND leased_at IS NOT NULL;
