-- Back to revision 0013_publish_handoff: the two functions this revision's
-- upgrade gave SET enable_seqscan = off lose it, and _publish_handoff is
-- restored as revision 0013_publish_handoff had it (without the due column),
-- which leaves each exactly as that revision had it.

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

