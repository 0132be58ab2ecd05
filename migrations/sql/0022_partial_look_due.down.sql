-- Back to revision 0021_reprocess_within_backlog: _consume_batch as that
-- revision had it (next_due only for a request that leased nothing).

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
