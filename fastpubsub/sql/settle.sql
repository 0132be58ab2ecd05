-- Settling leased messages: ack, nack, lease extension.
--
-- Each acts only on current leases of the subscription (a lease that has run
-- out is no longer the consumer's: it may already be someone else's) and
-- ignores other ids. Rows are reached one primary-key probe per id (_held),
-- whatever the statistics say: with statistics that call the subscription
-- small (a new table), the planner would rather read all of it.

-- Acknowledge: the rows move to acked_deliveries. Returns how many were acked.
-- While a stream is registered, `settled:<subscription>` wakes it.
CREATE OR REPLACE FUNCTION fastpubsub.ack(p_subscription_id text, p_ids uuid[])
RETURNS integer
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    n integer;
BEGIN
    WITH gone AS (
        DELETE FROM fastpubsub.deliveries AS d
        WHERE d.ctid = ANY (fastpubsub._held(s.key, p_ids)) AND d.lease_until > now()
        RETURNING d.message_id, d.attempts
    )
    INSERT INTO fastpubsub.acked_deliveries (acked_at, message_id, subscription_key, attempts)
    SELECT now(), gone.message_id, s.key, gone.attempts FROM gone;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 AND s.streaming_until > now() THEN
        PERFORM fastpubsub._notify(ARRAY['settled:' || s.id]);
    END IF;
    RETURN n;
END
$$;

-- Give leased messages back: they return after an exponential backoff of
-- min(backoff_max, backoff_min * 2^(attempts-1)) seconds, or go to the DLQ once
-- max_delivery_attempts is used up. Waiting consumers are woken whenever a
-- message goes back into the queue (they read the next due time again); a
-- registered stream also hears `settled:<subscription>`.
CREATE OR REPLACE FUNCTION fastpubsub.nack(p_subscription_id text, p_ids uuid[], OUT nacked integer, OUT dead_lettered integer)
RETURNS record
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
BEGIN
    WITH changed AS (
        UPDATE fastpubsub.deliveries AS d
        SET status = CASE WHEN d.attempts >= s.max_delivery_attempts
                          THEN 'dlq' ELSE 'scheduled' END::fastpubsub.delivery_status,
            visible_at = CASE WHEN d.attempts >= s.max_delivery_attempts THEN now()
                              ELSE now() + make_interval(secs => least(
                                  s.backoff_max_seconds::double precision,
                                  s.backoff_min_seconds * power(2::double precision, greatest(d.attempts, 1) - 1)))
                         END,
            lease_until = NULL,
            leased_at = NULL,
            consumer_id = NULL
        WHERE d.ctid = ANY (fastpubsub._held(s.key, p_ids)) AND d.lease_until > now()
        RETURNING d.status
    )
    SELECT count(*), count(*) FILTER (WHERE status = 'dlq') INTO nacked, dead_lettered FROM changed;
    IF nacked > 0 THEN
        PERFORM fastpubsub._notify(array_remove(ARRAY[
            CASE WHEN nacked > dead_lettered THEN s.id END,
            CASE WHEN s.streaming_until > now() THEN 'settled:' || s.id END], NULL));
    END IF;
END
$$;

-- Move the lease deadline of leased messages to now + p_seconds (0 ends the
-- lease: the message is deliverable again at once).
CREATE OR REPLACE FUNCTION fastpubsub.extend_lease(p_subscription_id text, p_ids uuid[], p_seconds integer)
RETURNS integer
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    n integer;
BEGIN
    IF p_seconds IS NULL OR p_seconds < 0 OR p_seconds > 3600 THEN
        RAISE EXCEPTION 'lease seconds must be between 0 and 3600' USING ERRCODE = 'FP422';
    END IF;
    UPDATE fastpubsub.deliveries AS d
    SET lease_until = now() + make_interval(secs => p_seconds)
    WHERE d.ctid = ANY (fastpubsub._held(s.key, p_ids)) AND d.lease_until > now();
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
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
    RETURN n;
END
$$;
