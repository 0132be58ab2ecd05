-- Metrics of a subscription, read through its partial index ranges only.

-- Counts for one subscription:
--   available  deliverable now (including due retries and leases that ran out)
--   delivered  leased and within their deadline (in flight)
--   delayed    not deliverable yet: retry backoff or a delayed publish
--   acked      acked and not cleaned up yet
--   dlq        dead-lettered (including rows with no attempt left that are not leased now)
--   oldest_available_age_seconds  age of the oldest deliverable message (consumer lag)
-- Every count reads one partial index range of this subscription; the oldest
-- deliverable message is the oldest of each priority's queue head and of the
-- due scheduled rows.
CREATE OR REPLACE FUNCTION fastpubsub.subscription_metrics(p_subscription_id text, OUT available bigint, OUT delivered bigint, OUT delayed bigint, OUT acked bigint, OUT dlq bigint, OUT oldest_available_age_seconds double precision)
RETURNS record
LANGUAGE plpgsql STABLE
SET enable_sort = off
SET enable_seqscan = off
SET jit = off
AS $$
DECLARE
    s fastpubsub.subscriptions := fastpubsub._subscription(p_subscription_id);
    v_now timestamptz := now();
    v_due bigint;
    v_exhausted bigint;
    v_oldest uuid;
    v_head uuid;
    v_priority smallint;
BEGIN
    SELECT count(*) FILTER (WHERE (d.lease_until IS NULL OR d.lease_until <= v_now)
                              AND d.attempts < s.max_delivery_attempts),
           count(*) FILTER (WHERE d.lease_until > v_now),
           count(*) FILTER (WHERE (d.lease_until IS NULL OR d.lease_until <= v_now)
                              AND d.attempts >= s.max_delivery_attempts)
    INTO available, delivered, v_exhausted
    FROM fastpubsub.deliveries AS d WHERE d.subscription_key = s.key AND d.status = 'available';

    v_priority := fastpubsub._next_priority(s.key, NULL);
    WHILE v_priority IS NOT NULL LOOP
        SELECT d.message_id INTO v_head
        FROM fastpubsub.deliveries AS d
        WHERE d.subscription_key = s.key AND d.status = 'available' AND d.priority = v_priority
          AND d.seq >= s.consume_from
          AND (d.lease_until IS NULL OR d.lease_until <= v_now) AND d.attempts < s.max_delivery_attempts
        ORDER BY d.seq LIMIT 1;
        IF v_head IS NOT NULL AND (v_oldest IS NULL OR v_head < v_oldest) THEN
            v_oldest := v_head;
        END IF;
        v_priority := fastpubsub._next_priority(s.key, v_priority);
    END LOOP;

    -- (uuid has no min() before PostgreSQL 18; its text form sorts the same way.)
    SELECT count(*) FILTER (WHERE d.visible_at <= v_now),
           count(*) FILTER (WHERE d.visible_at > v_now),
           min(d.message_id::text) FILTER (WHERE d.visible_at <= v_now)::uuid
    INTO v_due, delayed, v_head
    FROM fastpubsub.deliveries AS d WHERE d.subscription_key = s.key AND d.status = 'scheduled';
    IF v_head IS NOT NULL AND (v_oldest IS NULL OR v_head < v_oldest) THEN
        v_oldest := v_head;
    END IF;

    SELECT count(*) INTO dlq
    FROM fastpubsub.deliveries AS d WHERE d.subscription_key = s.key AND d.status = 'dlq';

    SELECT count(*) INTO acked FROM fastpubsub.acked_deliveries AS a WHERE a.subscription_key = s.key;

    available := available + v_due;
    dlq := dlq + v_exhausted;
    oldest_available_age_seconds := coalesce(
        (SELECT greatest(extract(epoch FROM v_now - m.created_at)::double precision, 0)
         FROM fastpubsub.messages AS m WHERE m.topic_key = s.topic_key AND m.id = v_oldest),
        0);
END
$$;

-- A topic at a glance: messages retained (published and not cleaned up yet),
-- how many were published in the last minute and hour (among those retained),
-- and the age of the oldest retained one. Ids carry their publish time, so
-- each count is a range of the primary key, read from the index alone.
-- (Its subscriptions' figures are subscription_metrics.)
CREATE OR REPLACE FUNCTION fastpubsub.topic_stats(
    p_topic_id text, OUT messages_retained bigint, OUT published_last_minute bigint,
    OUT published_last_hour bigint, OUT oldest_message_age_seconds double precision)
RETURNS record
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    v_topic_key integer;
    v_oldest uuid;
BEGIN
    SELECT key INTO v_topic_key FROM fastpubsub.topics WHERE id = p_topic_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'topic "%" not found', p_topic_id USING ERRCODE = 'FP404';
    END IF;
    SELECT count(*) INTO messages_retained FROM fastpubsub.messages AS m WHERE m.topic_key = v_topic_key;
    SELECT count(*) INTO published_last_hour FROM fastpubsub.messages AS m
    WHERE m.topic_key = v_topic_key AND m.id >= fastpubsub._message_id_floor(now() - interval '1 hour');
    SELECT count(*) INTO published_last_minute FROM fastpubsub.messages AS m
    WHERE m.topic_key = v_topic_key AND m.id >= fastpubsub._message_id_floor(now() - interval '1 minute');
    SELECT m.id INTO v_oldest FROM fastpubsub.messages AS m WHERE m.topic_key = v_topic_key ORDER BY m.id LIMIT 1;
    oldest_message_age_seconds := coalesce(
        (SELECT greatest(extract(epoch FROM now() - m.created_at)::double precision, 0)
         FROM fastpubsub.messages AS m WHERE m.topic_key = v_topic_key AND m.id = v_oldest),
        0);
END
$$;
