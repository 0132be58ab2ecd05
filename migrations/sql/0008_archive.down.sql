-- Back to revision 0005: the archive's ledger and functions go, and
-- cleanup_acked(integer, integer) is restored exactly as revision 0005 left
-- it (pg_get_functiondef of a database at 0005).

SET LOCAL check_function_bodies = off;

DROP FUNCTION fastpubsub.cleanup_acked(integer, integer, text);
DROP FUNCTION fastpubsub.archive_claim(text, integer);
DROP FUNCTION fastpubsub.archive_commit(bigint, text[], bigint, bigint);
DROP FUNCTION fastpubsub.archive_release(bigint);
DROP FUNCTION fastpubsub.archive_watermark(text);
DROP FUNCTION fastpubsub._archive_horizon(integer);
DROP FUNCTION fastpubsub._archive_batch_free(bigint);
DROP TABLE fastpubsub.archive_batches;

CREATE OR REPLACE FUNCTION fastpubsub.cleanup_acked(p_older_than_seconds integer, p_batch_size integer, OUT acked_deleted integer, OUT messages_deleted integer)
 RETURNS record
 LANGUAGE plpgsql
AS $function$
DECLARE
    v_cutoff timestamptz;
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
END
$function$

;
