-- Maintenance: the cleanup jobs (safe to run from several places at once).

-- Delete messages (of the given ids) that no delivery references any more.
CREATE OR REPLACE FUNCTION fastpubsub._delete_orphan_messages(p_topic_keys integer[], p_message_ids uuid[])
RETURNS integer
LANGUAGE plpgsql
SET enable_mergejoin = off
SET enable_hashjoin = off
SET jit = off
AS $$
DECLARE
    n integer;
BEGIN
    -- Two cleanups that each delete one of a message's last two references
    -- would each still see the other's and both keep the message, for good.
    -- So the candidates are locked first, always in the same order (no
    -- deadlock between cleanups), and the references are checked by the next
    -- statement: under READ COMMITTED it sees whatever the cleanup that held a
    -- lock before us committed.
    PERFORM 1
    FROM fastpubsub.messages AS m
    JOIN (SELECT DISTINCT c.topic_key, c.message_id
          FROM unnest(p_topic_keys, p_message_ids) AS c(topic_key, message_id)) AS c
      ON m.topic_key = c.topic_key AND m.id = c.message_id
    ORDER BY m.topic_key, m.id
    FOR UPDATE OF m;

    DELETE FROM fastpubsub.messages m
    USING (SELECT DISTINCT c.topic_key, c.message_id
           FROM unnest(p_topic_keys, p_message_ids) AS c(topic_key, message_id)) AS c
    WHERE m.topic_key = c.topic_key
      AND m.id = c.message_id
      AND NOT EXISTS (
          SELECT 1 FROM fastpubsub.subscriptions s
          JOIN fastpubsub.deliveries d ON d.subscription_key = s.key AND d.message_id = c.message_id
          WHERE s.topic_key = c.topic_key)
      AND NOT EXISTS (
          SELECT 1 FROM fastpubsub.subscriptions s
          JOIN fastpubsub.acked_deliveries a ON a.subscription_key = s.key AND a.message_id = c.message_id
          WHERE s.topic_key = c.topic_key);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- Delete up to p_batch_size acked deliveries older than p_older_than_seconds,
-- then the messages nothing references any more (and unrouted messages past the
-- same age), then up to p_batch_size messages past their topic's
-- retention_seconds with their deliveries (_cleanup_retention; its acked ones
-- are counted in acked_deleted). Call it until it returns fewer rows than the
-- batch: each call is a short transaction, and concurrent callers skip each
-- other's rows. With p_archived_in (an archive destination), only what that
-- archive holds goes: nothing created or acked after its watermark
-- (archive.sql), retention included.
CREATE OR REPLACE FUNCTION fastpubsub.cleanup_acked(
    p_older_than_seconds integer, p_batch_size integer, p_archived_in text,
    OUT acked_deleted integer, OUT messages_deleted integer)
RETURNS record
LANGUAGE plpgsql
AS $$
DECLARE
    v_cutoff timestamptz;
    v_watermark timestamptz;  -- with an archive: what it holds was created or acked before this
    v_retained record;
    v_topic_keys integer[];
    v_message_ids uuid[];
    n integer;
BEGIN
    IF p_older_than_seconds IS NULL OR p_older_than_seconds < 0 THEN
        RAISE EXCEPTION 'older than must be >= 0 seconds' USING ERRCODE = 'FP422';
    END IF;
    IF p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 1000000 THEN
        RAISE EXCEPTION 'batch size must be between 1 and 1000000' USING ERRCODE = 'FP422';
    END IF;
    v_cutoff := now() - make_interval(secs => p_older_than_seconds);
    IF p_archived_in IS NOT NULL THEN
        v_watermark := fastpubsub.archive_watermark(p_archived_in);
        v_cutoff := least(v_cutoff, v_watermark);
    END IF;

    WITH gone AS (
        DELETE FROM fastpubsub.acked_deliveries AS a
        WHERE a.ctid = ANY (ARRAY(
            SELECT x.ctid FROM fastpubsub.acked_deliveries AS x
            WHERE x.acked_at < v_cutoff
            LIMIT p_batch_size
            FOR UPDATE SKIP LOCKED))
        RETURNING a.subscription_key, a.message_id
    )
    SELECT coalesce(array_agg(s.topic_key), '{}'), coalesce(array_agg(gone.message_id), '{}'), count(*)
    INTO v_topic_keys, v_message_ids, acked_deleted
    FROM gone JOIN fastpubsub.subscriptions AS s ON s.key = gone.subscription_key;

    messages_deleted := fastpubsub._delete_orphan_messages(v_topic_keys, v_message_ids);

    DELETE FROM fastpubsub.messages AS m
    WHERE m.ctid = ANY (ARRAY(
        SELECT x.ctid FROM fastpubsub.messages AS x
        WHERE x.fanout = 0 AND x.created_at < v_cutoff
        LIMIT p_batch_size
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS n = ROW_COUNT;
    messages_deleted := messages_deleted + n;
    v_retained := fastpubsub._cleanup_retention(p_batch_size, v_watermark);
    messages_deleted := messages_deleted + v_retained.messages_deleted;
    acked_deleted := acked_deleted + v_retained.acked_deleted;
END
$$;

-- Delete up to p_batch_size messages older than their topic's
-- retention_seconds, oldest first, with every delivery of them, pending or
-- acked: pending ones count as expired for their subscription. Each topic's
-- old messages are one primary-key range (ids carry their publish time).
-- With p_archived_before (an archive's watermark), only messages created
-- before it none of whose acks came after it: what the archive holds.
-- Returns how many messages and acked deliveries were deleted.
CREATE OR REPLACE FUNCTION fastpubsub._cleanup_retention(
    p_batch_size integer, p_archived_before timestamptz, OUT messages_deleted integer, OUT acked_deleted integer)
RETURNS record
LANGUAGE plpgsql
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    t record;
    v_ids uuid[];
    v_subscription_keys integer[];
    v_counted integer[];
    v_backlog bigint[];
    v_expired bigint[];
    v_deleted integer := 0;
    n integer;
BEGIN
    acked_deleted := 0;
    FOR t IN SELECT key, retention_seconds FROM fastpubsub.topics
             WHERE retention_seconds IS NOT NULL ORDER BY key LOOP
        EXIT WHEN v_deleted >= p_batch_size;
        SELECT coalesce(array_agg(m.id), '{}') INTO v_ids
        FROM (SELECT x.id FROM fastpubsub.messages AS x
              WHERE x.topic_key = t.key
                AND x.id < fastpubsub._message_id_floor(
                    least(now() - make_interval(secs => t.retention_seconds), p_archived_before))
              ORDER BY x.id
              LIMIT p_batch_size - v_deleted
              FOR UPDATE SKIP LOCKED) AS m;
        CONTINUE WHEN cardinality(v_ids) = 0;
        SELECT coalesce(array_agg(s.key), '{}') INTO v_subscription_keys
        FROM fastpubsub.subscriptions AS s WHERE s.topic_key = t.key;
        IF p_archived_before IS NOT NULL THEN
            -- An ack after the watermark is not in the archive yet: its message waits.
            v_ids := ARRAY(SELECT i.id FROM unnest(v_ids) AS i(id)
                           EXCEPT
                           SELECT a.message_id FROM fastpubsub.acked_deliveries AS a
                           WHERE a.subscription_key = ANY (v_subscription_keys) AND a.message_id = ANY (v_ids)
                             AND a.acked_at >= p_archived_before);
            CONTINUE WHEN cardinality(v_ids) = 0;
        END IF;
        WITH gone AS (
            DELETE FROM fastpubsub.deliveries AS d
            WHERE d.subscription_key = ANY (v_subscription_keys) AND d.message_id = ANY (v_ids)
            RETURNING d.subscription_key, d.status
        ), counted AS (
            SELECT g.subscription_key AS key,
                   -count(*) FILTER (WHERE g.status <> 'dlq' AND s.max_backlog IS NOT NULL) AS backlog,
                   count(*) FILTER (WHERE g.status <> 'dlq') AS expired
            FROM gone AS g JOIN fastpubsub.subscriptions AS s ON s.key = g.subscription_key
            GROUP BY g.subscription_key
        )
        SELECT array_agg(c.key), array_agg(c.backlog), array_agg(c.expired)
        INTO v_counted, v_backlog, v_expired
        FROM counted AS c;
        PERFORM fastpubsub._count_all(v_counted, v_backlog, v_expired,
                                      array_fill(0::bigint, ARRAY[coalesce(cardinality(v_counted), 0)]));
        DELETE FROM fastpubsub.acked_deliveries AS a
        WHERE a.subscription_key = ANY (v_subscription_keys) AND a.message_id = ANY (v_ids);
        GET DIAGNOSTICS n = ROW_COUNT;
        acked_deleted := acked_deleted + n;
        DELETE FROM fastpubsub.messages AS m WHERE m.topic_key = t.key AND m.id = ANY (v_ids);
        GET DIAGNOSTICS n = ROW_COUNT;
        v_deleted := v_deleted + n;
    END LOOP;
    messages_deleted := v_deleted;
END
$$;

-- The same without an archive to wait for.
CREATE OR REPLACE FUNCTION fastpubsub.cleanup_acked(
    p_older_than_seconds integer, p_batch_size integer, OUT acked_deleted integer, OUT messages_deleted integer)
RETURNS record
LANGUAGE sql VOLATILE
AS $$
    SELECT * FROM fastpubsub.cleanup_acked(p_older_than_seconds, p_batch_size, NULL)
$$;

-- An idempotency key stands for its message while the message is retained:
-- keys older than the window whose message is gone are deleted.
CREATE OR REPLACE FUNCTION fastpubsub.cleanup_idempotency_keys(p_older_than_seconds integer, p_batch_size integer)
RETURNS integer
LANGUAGE plpgsql
SET enable_hashjoin = off
SET enable_mergejoin = off
SET jit = off
AS $$
DECLARE
    n integer;
BEGIN
    IF p_older_than_seconds IS NULL OR p_older_than_seconds < 0
       OR p_batch_size IS NULL OR p_batch_size < 1 OR p_batch_size > 1000000 THEN
        RAISE EXCEPTION 'older than must be >= 0 and batch size between 1 and 1000000' USING ERRCODE = 'FP422';
    END IF;
    DELETE FROM fastpubsub.idempotency_keys AS k
    WHERE k.ctid = ANY (ARRAY(
        SELECT x.ctid FROM fastpubsub.idempotency_keys AS x
        WHERE x.created_at < now() - make_interval(secs => p_older_than_seconds)
          AND NOT EXISTS (SELECT 1 FROM fastpubsub.messages AS m
                          WHERE m.topic_key = x.topic_key AND m.id = x.message_id)
        LIMIT p_batch_size
        FOR UPDATE SKIP LOCKED));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- End leases that were taken more than p_lock_timeout_seconds ago and have run
-- out: the message is deliverable again (released), or dead-lettered when no
-- attempt is left -- what the next consume would do on meeting it. A lease
-- still within its deadline, extended or not, is never cut short: the consumer
-- holding it is still entitled to ack. A lease taken at leased_at belongs to a
-- message published before it, so only that older part of each backlog is read.
CREATE OR REPLACE FUNCTION fastpubsub.cleanup_stuck(p_lock_timeout_seconds integer, OUT released integer, OUT dead_lettered integer)
RETURNS record
LANGUAGE plpgsql
AS $$
DECLARE
    v_cutoff timestamptz;
    n bigint;
BEGIN
    IF p_lock_timeout_seconds IS NULL OR p_lock_timeout_seconds < 0 THEN
        RAISE EXCEPTION 'lock timeout must be >= 0 seconds' USING ERRCODE = 'FP422';
    END IF;
    v_cutoff := now() - make_interval(secs => p_lock_timeout_seconds);
    WITH stuck AS MATERIALIZED (
        SELECT d.row_id, d.attempts >= s.max_delivery_attempts AS exhausted, s.key, s.max_backlog IS NOT NULL AS limited
        FROM fastpubsub.subscriptions AS s
        CROSS JOIN LATERAL (
            SELECT x.ctid AS row_id, x.attempts
            FROM fastpubsub.deliveries AS x
            WHERE x.subscription_key = s.key
              AND x.message_id < fastpubsub._message_id_floor(v_cutoff)
              AND x.lease_until <= now() AND x.leased_at < v_cutoff
            FOR UPDATE SKIP LOCKED
        ) AS d
    ), freed AS (
        UPDATE fastpubsub.deliveries AS d
        SET lease_until = NULL, leased_at = NULL, consumer_id = NULL
        WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM stuck WHERE NOT exhausted))
        RETURNING 1
    ), dead AS (
        UPDATE fastpubsub.deliveries AS d
        SET status = 'dlq', visible_at = now(), lease_until = NULL, leased_at = NULL, consumer_id = NULL
        WHERE d.ctid = ANY (ARRAY(SELECT row_id FROM stuck WHERE exhausted))
        RETURNING d.subscription_key
    ), left_backlog AS (
        -- dead letters leave the backlog of subscriptions that count theirs
        SELECT fastpubsub._count_all(array_agg(x.key), array_agg(-x.n), array_fill(0::bigint, ARRAY[count(*)::integer]),
                                     array_fill(0::bigint, ARRAY[count(*)::integer]))
        FROM (SELECT d.subscription_key AS key, count(*) AS n FROM dead AS d
              WHERE d.subscription_key IN (SELECT key FROM stuck WHERE limited)
              GROUP BY d.subscription_key) AS x
    )
    SELECT (SELECT count(*) FROM freed), (SELECT count(*) FROM dead), (SELECT count(*) FROM left_backlog)
    INTO released, dead_lettered, n;
END
$$;
