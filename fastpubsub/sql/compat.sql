-- Names of the previous release, kept for one release so that servers still
-- running it keep working while a new release rolls out (they call these).
-- Each is one line over the current function; none is for new code. They are
-- dropped by the first revision of the release after the one that added them
-- (docs/schema.md, "Changing the SQL").

-- (release 0.1: revision 0004) Publish; use publish or publish_envelopes.
CREATE OR REPLACE FUNCTION fastpubsub.publish_v2(p_topic_id text, p_messages jsonb, p_envelopes boolean)
RETURNS uuid[]
LANGUAGE sql VOLATILE
AS $$
    SELECT (fastpubsub._publish(p_topic_id, p_messages, p_envelopes, fastpubsub._transaction_offset(p_messages))).ids
$$;

-- (release 0.1: revision 0004) Lease messages; use consume.
CREATE OR REPLACE FUNCTION fastpubsub.consume_v2(p_subscription_id text, p_consumer_id text, p_batch_size integer)
RETURNS TABLE(id uuid, payload jsonb, attributes jsonb, priority smallint, attempts integer, created_at timestamptz)
LANGUAGE sql VOLATILE
AS $$
    SELECT c.id, c.payload, c.attributes, c.priority, c.attempts, c.created_at
    FROM fastpubsub.consume(p_subscription_id, p_consumer_id, p_batch_size) AS c
$$;

-- (release 0.1: revision 0004) End stuck leases; use cleanup_stuck.
CREATE OR REPLACE FUNCTION fastpubsub.cleanup_stuck_v2(
    p_lock_timeout_seconds integer, OUT released integer, OUT dead_lettered integer)
LANGUAGE sql VOLATILE
AS $$
    SELECT * FROM fastpubsub.cleanup_stuck(p_lock_timeout_seconds)
$$;

-- (release 0.2: revision 0007) Create a subscription with positional
-- policies; use create_subscription(id, topic_id, options, start).
CREATE OR REPLACE FUNCTION fastpubsub.create_subscription(
    p_id text, p_topic_id text, p_filter jsonb, p_max_delivery_attempts integer, p_backoff_min_seconds integer,
    p_backoff_max_seconds integer, p_ack_deadline_seconds integer)
RETURNS fastpubsub.subscriptions
LANGUAGE sql VOLATILE
AS $$
    SELECT fastpubsub.create_subscription(p_id, p_topic_id, jsonb_build_object(
        'filter', p_filter, 'max_delivery_attempts', p_max_delivery_attempts,
        'backoff_min_seconds', p_backoff_min_seconds, 'backoff_max_seconds', p_backoff_max_seconds,
        'ack_deadline_seconds', p_ack_deadline_seconds), NULL)
$$;

-- (release 0.2: revision 0007) Change a subscription, NULL keeping a value;
-- use update_subscription(id, changes).
CREATE OR REPLACE FUNCTION fastpubsub.update_subscription(
    p_id text, p_set_filter boolean, p_filter jsonb, p_max_delivery_attempts integer, p_backoff_min_seconds integer,
    p_backoff_max_seconds integer, p_ack_deadline_seconds integer)
RETURNS fastpubsub.subscriptions
LANGUAGE sql VOLATILE
AS $$
    SELECT fastpubsub.update_subscription(p_id, jsonb_strip_nulls(jsonb_build_object(
        'max_delivery_attempts', p_max_delivery_attempts, 'backoff_min_seconds', p_backoff_min_seconds,
        'backoff_max_seconds', p_backoff_max_seconds, 'ack_deadline_seconds', p_ack_deadline_seconds))
        || CASE WHEN p_set_filter THEN jsonb_build_object('filter', p_filter) ELSE '{}'::jsonb END)
$$;
