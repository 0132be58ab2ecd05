-- Settling leased messages: ack, nack, lease extension.
--
-- Each acts only on current leases of the subscription (a lease that has run
-- out is no longer the consumer's: it may already be someone else's) and
-- ignores other ids. By message id (ack, nack, extend_lease: what seed clients
-- send) any current lease of the message counts; by receipt (ack_receipts,
-- nack_receipts, extend_lease_receipts) only the lease the receipt was handed
-- out with, and each receipt gets its own outcome (the API and the group
-- commit use _settle_batch, which does any of them). Rows are reached one
-- primary-key probe per id (_held, _held_receipts), whatever the statistics say:
-- with statistics that call the subscription small (a new table), the planner
-- would rather read all of it. The _*_rows functions do the work for both.

-- The current leases these receipts name: the place of each receipt that
-- names one, and its row (one probe per receipt).
CREATE OR REPLACE FUNCTION fastpubsub._held_receipts(p_subscription_key integer, p_receipts text[])
RETURNS TABLE(pos bigint, row_id tid)
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN QUERY
        SELECT r.pos, h.row_id
        FROM unnest(p_receipts) WITH ORDINALITY AS r(receipt, pos)
        CROSS JOIN LATERAL fastpubsub._receipt_lease(r.receipt) AS l
        CROSS JOIN LATERAL (
            SELECT d.ctid AS row_id FROM fastpubsub.deliveries AS d
            WHERE d.subscription_key = p_subscription_key AND d.message_id = l.message_id
              AND d.lease_until > now() AND fastpubsub._micros(d.leased_at) = l.leased_micros
            LIMIT 1
        ) AS h;
END
$$;

-- Acknowledge the leased rows at p_rows: they move to acked_deliveries, with
-- when their lease was taken. Returns their message ids. A registered stream
-- hears `settled:<subscription>`.
CREATE OR REPLACE FUNCTION fastpubsub._ack_rows(s fastpubsub.subscriptions, p_rows tid[])
RETURNS uuid[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_done uuid[];
BEGIN
    WITH gone AS (
        DELETE FROM fastpubsub.deliveries AS d
        WHERE d.ctid = ANY (p_rows) AND d.lease_until > now()
        RETURNING d.message_id, d.attempts, d.leased_at
    ), kept AS (
        INSERT INTO fastpubsub.acked_deliveries (acked_at, message_id, subscription_key, attempts, leased_at)
        SELECT now(), gone.message_id, s.key, gone.attempts, gone.leased_at FROM gone
        RETURNING message_id
    )
    SELECT coalesce(array_agg(kept.message_id), '{}') INTO v_done FROM kept;
    IF cardinality(v_done) > 0 AND s.streaming_until > now() THEN
        PERFORM fastpubsub._notify(ARRAY['settled:' || s.id], ARRAY[cardinality(v_done)]);
    END IF;
    RETURN v_done;
END
$$;

-- Give the leased rows at p_rows back: they return after the subscription's
-- backoff (_retry_delay), or go to the DLQ once max_delivery_attempts is used
-- up, or at once when p_requeue is false. Returns the message ids given back, those dead-lettered, and how many
-- are deliverable again at once (backoff 0). Waiting
-- consumers hear of messages back in the queue now (or of a new due time); a
-- registered stream also hears `settled:<subscription>`. A row given back
-- holds no lease (lease_until NULL) but keeps when the nacked one was taken
-- (leased_at, until its next lease): a nack by receipt sent again after it
-- landed is answered as it was (_settle_batch).
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

-- Seconds before a message that failed its p_attempts-th attempt is tried
-- again, by the subscription's retry_policy: fixed backoff_min, linear
-- backoff_min * attempts, or exponential backoff_min * 2^(attempts-1); capped
-- at backoff_max; retry_jitter takes up to that fraction off at random. One
-- expression, inlined into _nack_rows.
CREATE OR REPLACE FUNCTION fastpubsub._retry_delay(s fastpubsub.subscriptions, p_attempts integer)
RETURNS double precision
LANGUAGE sql VOLATILE
AS $$
    SELECT least(s.backoff_max_seconds::double precision,
                 CASE s.retry_policy
                     WHEN 'fixed' THEN s.backoff_min_seconds::double precision
                     WHEN 'linear' THEN s.backoff_min_seconds * greatest(p_attempts, 1)::double precision
                     ELSE s.backoff_min_seconds * power(2::double precision, greatest(p_attempts, 1) - 1)
                 END)
           * (1 - s.retry_jitter * random())
$$;

-- Move the deadline of the leased rows at p_rows to now + p_seconds (0 ends
-- the lease: the message is deliverable again at once). Returns their ids.
CREATE OR REPLACE FUNCTION fastpubsub._extend_rows(s fastpubsub.subscriptions, p_rows tid[], p_seconds integer)
RETURNS uuid[]
LANGUAGE plpgsql
AS $$
DECLARE
    v_done uuid[];
BEGIN
    IF p_seconds IS NULL OR p_seconds < 0 OR p_seconds > 3600 THEN
        RAISE EXCEPTION 'lease seconds must be between 0 and 3600' USING ERRCODE = 'FP422';
    END IF;
    WITH moved AS (
        UPDATE fastpubsub.deliveries AS d
        SET lease_until = now() + make_interval(secs => p_seconds)
        WHERE d.ctid = ANY (p_rows) AND d.lease_until > now()
        RETURNING d.message_id
    )
    SELECT coalesce(array_agg(moved.message_id), '{}') INTO v_done FROM moved;
    IF p_seconds = 0 AND cardinality(v_done) > 0 THEN
        PERFORM fastpubsub._notify(ARRAY[s.id], ARRAY[cardinality(v_done)]);
    END IF;
    RETURN v_done;
END
$$;

-- Acknowledge leased messages; other ids are ignored. Returns how many were acked.
CREATE OR REPLACE FUNCTION fastpubsub.ack(p_subscription_id text, p_ids uuid[])
RETURNS integer
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    n integer;
BEGIN
    n := cardinality(fastpubsub._ack_rows(s, fastpubsub._held(s.key, p_ids)));
    IF n > 0 AND s.max_backlog IS NOT NULL THEN
        PERFORM fastpubsub._count(s.key, -n, 0, 0);
    END IF;
    RETURN n;
END
$$;

-- Give leased messages back for a retry after backoff (or to the DLQ once
-- max_delivery_attempts is used up); other ids are ignored.
CREATE OR REPLACE FUNCTION fastpubsub.nack(
    p_subscription_id text, p_ids uuid[], OUT nacked integer, OUT dead_lettered integer)
RETURNS record
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    v record;
BEGIN
    v := fastpubsub._nack_rows(s, fastpubsub._held(s.key, p_ids), true);
    nacked := cardinality(v.done);
    dead_lettered := cardinality(v.dead);
    IF dead_lettered > 0 AND s.max_backlog IS NOT NULL THEN
        PERFORM fastpubsub._count(s.key, -dead_lettered, 0, 0);
    END IF;
END
$$;

-- Move the lease deadline of leased messages to now + p_seconds (0 ends the
-- lease: the message is deliverable again at once). Returns how many moved.
CREATE OR REPLACE FUNCTION fastpubsub.extend_lease(p_subscription_id text, p_ids uuid[], p_seconds integer)
RETURNS integer
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
BEGIN
    RETURN cardinality(fastpubsub._extend_rows(s, fastpubsub._held(s.key, p_ids), p_seconds));
END
$$;

-- Several settlements in one transaction (group commit): p_requests is an
-- array of {"subscription": id, "action": "ack" | "nack" | "extend",
-- "ids": [...] | "receipts": [...], "seconds": n, "requeue": bool}. One result
-- per request, in the same order:
-- {"done": n, "dead": n, "ready": n, "streaming": bool, "outcomes": [...]}
-- (outcomes for receipts only; ready: messages deliverable again at once).
--
-- Requests that ask the same of the same subscription (same action, options
-- and kind) are settled together, in one statement, as if one after the
-- other in request order: an id or receipt counts for the first request that
-- names it, and a receipt only when it names the lease that was settled. A
-- group's `ready` comes with its first request (the others say 0).
-- Backlog counts of subscriptions with a max_backlog change once, at the end,
-- in key order (_count_all). All are committed or none is; a caller that gets
-- an error retries the
-- requests one at a time to find whose it was.
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
                                      -- a nack of this very lease landed before: its outcome
                                      -- again, counted once (_nack_rows keeps leased_at; the
                                      -- next lease of the message changes it)
                                      WHEN g.action = 'nack' THEN coalesce((
                                          SELECT CASE WHEN d.status = 'dlq' THEN 'dead_lettered' ELSE 'nacked' END
                                          FROM fastpubsub.deliveries AS d
                                          WHERE d.subscription_key = s.key AND d.message_id = t.message_id
                                            AND d.lease_until IS NULL
                                            AND fastpubsub._micros(d.leased_at) = t.leased_micros), 'lease not held')
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

-- By receipt: each receipt with its outcome, in order: 'acknowledged',
-- 'nacked' (it will be retried), 'dead_lettered', 'extended', or 'lease not
-- held' (it ran out, was settled already, or is someone else's) or 'invalid
-- receipt'. An ack of a lease whose ack landed already is 'acknowledged'
-- again, a nack of a lease whose nack landed 'nacked' or 'dead_lettered' as
-- it was (each counted once). One request of _settle_batch each.
CREATE OR REPLACE FUNCTION fastpubsub._settle_receipts(p_request jsonb)
RETURNS TABLE(receipt text, outcome text)
LANGUAGE sql
AS $$
    SELECT r.receipt, o.outcome
    FROM fastpubsub._settle_batch(jsonb_build_array(p_request)) AS b
    CROSS JOIN LATERAL jsonb_array_elements_text(p_request -> 'receipts') WITH ORDINALITY AS r(receipt, ord)
    JOIN jsonb_array_elements_text(b.result -> 'outcomes') WITH ORDINALITY AS o(outcome, ord) ON o.ord = r.ord
    ORDER BY r.ord
$$;

CREATE OR REPLACE FUNCTION fastpubsub.ack_receipts(p_subscription_id text, p_receipts text[])
RETURNS TABLE(receipt text, outcome text)
LANGUAGE sql
AS $$
    SELECT * FROM fastpubsub._settle_receipts(jsonb_build_object(
        'subscription', p_subscription_id, 'action', 'ack', 'receipts', to_jsonb(coalesce(p_receipts, '{}'))))
$$;

-- p_requeue false: straight to the DLQ, no more attempts.
CREATE OR REPLACE FUNCTION fastpubsub.nack_receipts(p_subscription_id text, p_receipts text[], p_requeue boolean)
RETURNS TABLE(receipt text, outcome text)
LANGUAGE sql
AS $$
    SELECT * FROM fastpubsub._settle_receipts(jsonb_build_object(
        'subscription', p_subscription_id, 'action', 'nack', 'receipts', to_jsonb(coalesce(p_receipts, '{}')),
        'requeue', coalesce(p_requeue, true)))
$$;

CREATE OR REPLACE FUNCTION fastpubsub.extend_lease_receipts(
    p_subscription_id text, p_receipts text[], p_seconds integer)
RETURNS TABLE(receipt text, outcome text)
LANGUAGE sql
AS $$
    SELECT * FROM fastpubsub._settle_receipts(jsonb_build_object(
        'subscription', p_subscription_id, 'action', 'extend', 'receipts', to_jsonb(coalesce(p_receipts, '{}')),
        'seconds', p_seconds))
$$;

-- Deliveries that are not leased now and have no attempt left belong in the
-- DLQ (consume moves them as it meets them; this does it for a whole
-- subscription before the DLQ is read).
CREATE OR REPLACE FUNCTION fastpubsub._settle_exhausted(s fastpubsub.subscriptions)
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    n integer;
BEGIN
    UPDATE fastpubsub.deliveries AS d
    SET status = 'dlq', visible_at = now(), lease_until = NULL, leased_at = NULL, consumer_id = NULL
    WHERE d.ctid = ANY (ARRAY(
        SELECT x.ctid FROM fastpubsub.deliveries AS x
        WHERE x.subscription_key = s.key AND x.status = 'available'
          AND (x.lease_until IS NULL OR x.lease_until <= now()) AND x.attempts >= s.max_delivery_attempts
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 AND s.max_backlog IS NOT NULL THEN
        PERFORM fastpubsub._count(s.key, -n, 0, 0);
    END IF;
    RETURN n;
END
$$;
