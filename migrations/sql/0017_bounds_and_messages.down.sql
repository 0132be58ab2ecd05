-- Back to revision 0016_grouped_acks: _message_id_floor and _make_room as that
-- revision had them (a time before 1970 gave the largest id bound, and a
-- publish refused for want of room said the backlog held what would have been
-- left after the drops).

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
