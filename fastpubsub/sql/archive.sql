-- The archive's ledger: which batches of acked history `fastpubsub archive`
-- has exported to a destination, and which run is exporting what.
--
-- A run claims one batch at a time and holds a session-level advisory lock
-- on it (namespace 1718645603, 'fpsc', the batch id) for as long as it works
-- on it. A batch nobody holds a lock on and nobody committed belongs to a run
-- that stopped (killed, crashed, its connection lost): the next claim takes it
-- over, with the same range, so it is exported again under the same file
-- names. Claims are drawn one at a time per destination (transaction lock in
-- namespace 1718645601, 'fpsa'), so two runs, on one machine or two, never
-- draw overlapping batches.

-- The time before which every message and ack is committed: publish and ack
-- stamp rows with their transaction's start, so no transaction still running
-- can add a row older than its start. Sessions of other roles show no
-- xact_start without pg_read_all_stats; p_settle_seconds covers those (and a
-- transaction that starts while this one reads the list).
CREATE OR REPLACE FUNCTION fastpubsub._archive_horizon(p_settle_seconds integer)
RETURNS timestamptz
LANGUAGE sql STABLE
AS $$
    SELECT least(
        now() - make_interval(secs => p_settle_seconds),
        (SELECT min(a.xact_start) FROM pg_stat_activity AS a
         WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
           AND a.backend_type = 'client backend' AND a.xact_start IS NOT NULL
           -- reports and archive runs only read
           AND a.application_name NOT IN ('fastpubsub-report', 'fastpubsub-archive')))
$$;

-- True when no session holds the batch's lock: no run is working on it.
CREATE OR REPLACE FUNCTION fastpubsub._archive_batch_free(p_batch_id bigint)
RETURNS boolean
LANGUAGE sql STABLE
AS $$
    SELECT NOT EXISTS (
        SELECT 1 FROM pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid = 1718645603 AND l.objid = (p_batch_id % 2147483648)::oid AND l.objsubid = 2)
$$;

-- The next batch for this session to export to p_destination, none when
-- everything before the horizon is exported or being exported. A batch whose
-- run stopped comes first; otherwise a new one starts where the last one
-- ended (the first at -infinity) and ends at the next UTC midnight after the
-- oldest row it holds, or at the horizon, whichever comes first: a batch
-- holds one UTC day at most.
CREATE OR REPLACE FUNCTION fastpubsub.archive_claim(p_destination text, p_settle_seconds integer)
RETURNS SETOF fastpubsub.archive_batches
LANGUAGE plpgsql
AS $$
DECLARE
    b fastpubsub.archive_batches;
    v_from timestamptz;
    v_horizon timestamptz;
    v_first timestamptz;
BEGIN
    IF p_destination IS NULL OR p_destination = '' THEN
        RAISE EXCEPTION 'an archive needs a destination' USING ERRCODE = 'FP422';
    END IF;
    IF p_settle_seconds IS NULL OR p_settle_seconds < 0 THEN
        RAISE EXCEPTION 'settle seconds must be >= 0' USING ERRCODE = 'FP422';
    END IF;
    PERFORM pg_advisory_xact_lock(1718645601, hashtext(p_destination));

    FOR b IN
        SELECT * FROM fastpubsub.archive_batches AS x
        WHERE x.destination = p_destination AND x.committed_at IS NULL
        ORDER BY x.starts_at
    LOOP
        IF fastpubsub._archive_batch_free(b.id) THEN
            PERFORM pg_advisory_lock(1718645603, (b.id % 2147483648)::integer);
            UPDATE fastpubsub.archive_batches AS x SET claims = x.claims + 1, claimed_at = now()
            WHERE x.id = b.id RETURNING * INTO b;
            RETURN NEXT b;
            RETURN;
        END IF;
    END LOOP;

    SELECT coalesce(max(x.ends_at), '-infinity') INTO v_from
    FROM fastpubsub.archive_batches AS x WHERE x.destination = p_destination;
    v_horizon := fastpubsub._archive_horizon(p_settle_seconds);
    IF v_from >= v_horizon THEN
        RETURN;
    END IF;
    SELECT least(
        (SELECT min(m.created_at) FROM fastpubsub.messages AS m
         WHERE m.created_at >= v_from AND m.created_at < v_horizon),
        (SELECT min(a.acked_at) FROM fastpubsub.acked_deliveries AS a
         WHERE a.acked_at >= v_from AND a.acked_at < v_horizon))
    INTO v_first;
    INSERT INTO fastpubsub.archive_batches (destination, starts_at, ends_at, claimed_at)
    VALUES (p_destination, v_from,
            CASE WHEN v_first IS NULL THEN v_horizon
                 ELSE least(v_horizon, date_trunc('day', v_first, 'UTC') + interval '1 day') END,
            now())
    RETURNING * INTO b;
    PERFORM pg_advisory_lock(1718645603, (b.id % 2147483648)::integer);
    RETURN NEXT b;
END
$$;

-- Record a batch as exported, with its files and row counts, and let go of
-- it. Only the session that claimed it may: false when this session does not
-- hold it (another run took it over after this one lost its connection).
CREATE OR REPLACE FUNCTION fastpubsub.archive_commit(
    p_batch_id bigint, p_files text[], p_messages bigint, p_acked_deliveries bigint)
RETURNS boolean
LANGUAGE plpgsql
AS $$
DECLARE
    n integer;
BEGIN
    IF NOT EXISTS (
        SELECT 1 FROM pg_locks AS l
        WHERE l.locktype = 'advisory' AND l.pid = pg_backend_pid() AND l.granted
          AND l.classid = 1718645603 AND l.objid = (p_batch_id % 2147483648)::oid AND l.objsubid = 2)
    THEN
        RETURN false;
    END IF;
    UPDATE fastpubsub.archive_batches AS x
    SET committed_at = now(), files = coalesce(p_files, '{}'), messages = p_messages,
        acked_deliveries = p_acked_deliveries
    WHERE x.id = p_batch_id AND x.committed_at IS NULL;
    GET DIAGNOSTICS n = ROW_COUNT;
    PERFORM pg_advisory_unlock(1718645603, (p_batch_id % 2147483648)::integer);
    RETURN n = 1;
END
$$;

-- Let go of a batch without committing it (a run that failed): another run
-- takes it over at once instead of when this session ends.
CREATE OR REPLACE FUNCTION fastpubsub.archive_release(p_batch_id bigint)
RETURNS boolean
LANGUAGE sql
AS $$
    SELECT pg_advisory_unlock(1718645603, (p_batch_id % 2147483648)::integer)
$$;

-- Everything created or acked before this time is in the archive at
-- p_destination: the end of its committed batches, up to the first one that
-- is not committed yet. -infinity when nothing is.
CREATE OR REPLACE FUNCTION fastpubsub.archive_watermark(p_destination text)
RETURNS timestamptz
LANGUAGE sql STABLE
AS $$
    SELECT least(
        coalesce(min(x.starts_at) FILTER (WHERE x.committed_at IS NULL), 'infinity'),
        coalesce(max(x.ends_at) FILTER (WHERE x.committed_at IS NOT NULL), '-infinity'))
    FROM fastpubsub.archive_batches AS x
    WHERE x.destination = p_destination
$$;
