-- Every query fastpubsub runs at run time, one per `-- name --` header.
-- fastpubsub.sql.source parses this file once and fastpubsub.db.queries calls
-- the queries by name; each is one statement, so each call is one round trip.

-- ping --
SELECT 1

-- schema_revision --
-- The Alembic revision the database is at (readiness compares it with the code's).
SELECT version_num FROM fastpubsub.alembic_version

-- create_topic --
SELECT id, created_at, retention_seconds FROM fastpubsub.create_topic(:id, CAST(:options AS jsonb))

-- get_topic --
SELECT id, created_at, retention_seconds FROM fastpubsub.topics WHERE id = :id

-- list_topics --
SELECT id, created_at, retention_seconds FROM fastpubsub.topics ORDER BY id OFFSET :offset LIMIT :limit

-- update_topic --
SELECT id, created_at, retention_seconds FROM fastpubsub.update_topic(:id, CAST(:changes AS jsonb))

-- topic_stats --
SELECT messages_retained, published_last_minute, published_last_hour, oldest_message_age_seconds
FROM fastpubsub.topic_stats(:topic_id)

-- topic_subscription_metrics --
-- The metrics of every subscription of a topic (subscription_metrics each).
SELECT s.id AS subscription_id, m.available, m.delivered, m.delayed, m.acked, m.dlq,
       m.oldest_available_age_seconds, coalesce(c.expired, 0) AS expired, coalesce(c.dropped, 0) AS dropped,
       s.max_backlog
FROM fastpubsub.topics AS t
JOIN fastpubsub.subscriptions AS s ON s.topic_key = t.key
CROSS JOIN LATERAL fastpubsub.subscription_metrics(s.id) AS m
LEFT JOIN fastpubsub.subscription_counts AS c ON c.subscription_key = s.key
WHERE t.id = :topic_id
ORDER BY s.id

-- delete_topic --
SELECT fastpubsub.delete_topic(:id)

-- create_subscription --
SELECT s.id, t.id AS topic_id, s.filter, s.max_delivery_attempts, s.backoff_min_seconds,
       s.backoff_max_seconds, s.ack_deadline_seconds, s.created_at, s.updated_at, s.retry_policy,
       s.retry_jitter, s.message_ttl_seconds, s.expiry_policy, s.max_backlog, s.backlog_policy,
       s.backfill_next IS NOT NULL AS backfilling, s.push,
       CASE WHEN s.push_secret = CAST(:options AS jsonb) ->> 'push_secret' THEN s.push_secret END AS new_push_secret,
       s.push_previous_secret_until
FROM fastpubsub.create_subscription(:id, :topic_id, CAST(:options AS jsonb), CAST(:start AS text)) AS s
JOIN fastpubsub.topics AS t ON t.key = s.topic_key

-- get_subscription --
SELECT s.id, t.id AS topic_id, s.filter, s.max_delivery_attempts, s.backoff_min_seconds,
       s.backoff_max_seconds, s.ack_deadline_seconds, s.created_at, s.updated_at, s.retry_policy,
       s.retry_jitter, s.message_ttl_seconds, s.expiry_policy, s.max_backlog, s.backlog_policy,
       s.backfill_next IS NOT NULL AS backfilling, s.push, NULL AS new_push_secret,
       s.push_previous_secret_until
FROM fastpubsub.subscriptions AS s
JOIN fastpubsub.topics AS t ON t.key = s.topic_key
WHERE s.id = :id

-- list_subscriptions --
SELECT s.id, t.id AS topic_id, s.filter, s.max_delivery_attempts, s.backoff_min_seconds,
       s.backoff_max_seconds, s.ack_deadline_seconds, s.created_at, s.updated_at, s.retry_policy,
       s.retry_jitter, s.message_ttl_seconds, s.expiry_policy, s.max_backlog, s.backlog_policy,
       s.backfill_next IS NOT NULL AS backfilling, s.push, NULL AS new_push_secret,
       s.push_previous_secret_until
FROM fastpubsub.subscriptions AS s
JOIN fastpubsub.topics AS t ON t.key = s.topic_key
ORDER BY s.id OFFSET :offset LIMIT :limit

-- update_subscription --
SELECT s.id, t.id AS topic_id, s.filter, s.max_delivery_attempts, s.backoff_min_seconds,
       s.backoff_max_seconds, s.ack_deadline_seconds, s.created_at, s.updated_at, s.retry_policy,
       s.retry_jitter, s.message_ttl_seconds, s.expiry_policy, s.max_backlog, s.backlog_policy,
       s.backfill_next IS NOT NULL AS backfilling, s.push,
       CASE WHEN s.push_secret = CAST(:changes AS jsonb) ->> 'push_secret' THEN s.push_secret END AS new_push_secret,
       s.push_previous_secret_until
FROM fastpubsub.update_subscription(:id, CAST(:changes AS jsonb)) AS s
JOIN fastpubsub.topics AS t ON t.key = s.topic_key

-- rotate_push_secret --
-- new_push_secret: the secret, shown once.
SELECT s.id, t.id AS topic_id, s.filter, s.max_delivery_attempts, s.backoff_min_seconds,
       s.backoff_max_seconds, s.ack_deadline_seconds, s.created_at, s.updated_at, s.retry_policy,
       s.retry_jitter, s.message_ttl_seconds, s.expiry_policy, s.max_backlog, s.backlog_policy,
       s.backfill_next IS NOT NULL AS backfilling, s.push,
       CASE WHEN s.push_secret = :push_secret THEN s.push_secret END AS new_push_secret,
       s.push_previous_secret_until
FROM fastpubsub.rotate_push_secret(:id, :push_secret, :grace_seconds) AS s
JOIN fastpubsub.topics AS t ON t.key = s.topic_key

-- push_subscriptions --
-- What `fastpubsub push-worker` delivers: every push subscription with its
-- secrets (the previous one while its grace period lasts).
SELECT s.id, t.id AS topic_id, s.push, s.ack_deadline_seconds, s.push_secret,
       CASE WHEN s.push_previous_secret_until > now() THEN s.push_previous_secret END AS previous_secret
FROM fastpubsub.subscriptions AS s
JOIN fastpubsub.topics AS t ON t.key = s.topic_key
WHERE s.push IS NOT NULL
ORDER BY s.id

-- backfill --
SELECT added, done, busy FROM fastpubsub.backfill(:subscription_id, :batch_size)

-- pending_backfills --
-- Subscriptions whose retained messages are still being added (see backfill).
SELECT id FROM fastpubsub.subscriptions WHERE backfill_next IS NOT NULL ORDER BY id

-- peek --
SELECT id, payload, attempts, created_at, attributes, priority, state, expires_at
FROM fastpubsub.peek(:subscription_id, :limit)

-- seek --
SELECT replayed, acked FROM fastpubsub.seek(:subscription_id, :time)

-- leases_held --
SELECT d.message_id::text AS message_id, extract(epoch FROM d.lease_until - now())::double precision AS seconds
FROM fastpubsub.deliveries AS d
JOIN fastpubsub.subscriptions AS s ON s.key = d.subscription_key
WHERE s.id = :subscription_id AND d.message_id = ANY (CAST(:ids AS uuid[]))
  AND d.consumer_id = :consumer_id AND d.lease_until > now()

-- touch_stream --
SELECT fastpubsub.touch_stream(:subscription_id)

-- delete_subscription --
SELECT fastpubsub.delete_subscription(:id)

-- publish_batch --
-- Several publish requests in one transaction (group commit): one row per
-- request, in order (topics, JSON bodies and envelope flags as arrays).
SELECT ids, woken, woken_counts
FROM fastpubsub._publish_batch(CAST(:topics AS text[]), CAST(:bodies AS text[]), CAST(:envelopes AS boolean[]))

-- publish_one --
-- A group commit of one publish request (what an idle server mostly sees):
-- what publish_batch does for a single request, without its bookkeeping for
-- several (a fifth of a one-message publish's time in PostgreSQL).
SELECT ids, woken, woken_counts
FROM fastpubsub._publish(:topic, CAST(:body AS jsonb), :envelopes, 0)

-- publish_handoff --
-- publish_batch (or publish_one, for one request) that also leases the new
-- messages to consumers waiting in this process, in the same transaction
-- (see _publish_handoff): the requests' rows, then one (ids, events, due) row
-- per waiting consumer.
SELECT ids, woken, woken_counts, events, due
FROM fastpubsub._publish_handoff(
    CAST(:topics AS text[]), CAST(:bodies AS text[]), CAST(:envelopes AS boolean[]),
    CAST(:subscriptions AS text[]), CAST(:consumers AS text[]), CAST(:sizes AS integer[]))

-- settle_batch --
-- Several acks, nacks and lease extensions in one transaction (group commit).
SELECT result FROM fastpubsub._settle_batch(CAST(:requests AS jsonb))

-- notify --
-- Wake consumers in other server processes (a coalesced notification, sent
-- outside any data transaction). Its commit does not wait for the WAL flush:
-- a notification keeps nothing across a crash, the data it announces was
-- committed durably before it was sent, and listeners hear it only after its
-- commit returns, so a flush here would only delay every wake-up.
SELECT pg_notify('fastpubsub', :payload), set_config('synchronous_commit', 'off', true)

-- publish --
SELECT fastpubsub.publish(:topic_id, CAST(:payloads AS jsonb)) AS ids

-- publish_envelopes --
SELECT fastpubsub.publish_envelopes(:topic_id, CAST(:messages AS jsonb)) AS ids

-- consume --
-- _lease itself, not the consume wrapper: PostgreSQL does not inline a
-- volatile SQL function, so the wrapper would be parsed and planned again on
-- every call (docs/schema.md, "Plans that last").
SELECT id, payload, attempts, created_at, attributes, priority, receipt
FROM fastpubsub._lease(:subscription_id, ARRAY[CAST(:consumer_id AS text)], ARRAY[CAST(:batch_size AS integer)])

-- consume_events --
-- One row per leased message: its id (as text) and its JSON (as consume_json renders it),
-- for streams, which send one event per message; when fewer than batch_size
-- were leased (all there was), also one row with no message and next_due, first
-- (one round trip per look), as of after the lease (_next_due_after_lease).
WITH c AS MATERIALIZED (
    SELECT c.id, c.ord, fastpubsub._message_json(
               c.id, :subscription_id, c.payload, c.attempts, c.created_at, c.attributes, c.priority, c.receipt
           )::text AS data
    FROM fastpubsub._lease(:subscription_id, ARRAY[CAST(:consumer_id AS text)], ARRAY[CAST(:batch_size AS integer)])
        WITH ORDINALITY AS c(slot, id, payload, attributes, priority, attempts, created_at, receipt, ord)
)
SELECT c.id::text, c.data, NULL::double precision AS due, c.ord FROM c
UNION ALL
SELECT NULL, NULL, fastpubsub._next_due_after_lease(:subscription_id), 0
WHERE (SELECT count(*) FROM c) < CAST(:batch_size AS integer)
ORDER BY 4

-- consume_batch --
-- Leasing, rendered as the API's JSON array by PostgreSQL itself (the hottest
-- answer of the API then costs Python one string), for several requests in
-- one transaction (group commit): one row per request, in order. When a
-- request leased fewer than it asked for (all there was), `due` says how many
-- seconds until a retry, delayed message or lease end may change that (NULL:
-- nothing pending), so a long-poll look is one round trip.
SELECT leased, data, due
FROM fastpubsub._consume_batch(
    CAST(:subscriptions AS text[]), CAST(:consumers AS text[]), CAST(:sizes AS integer[]))

-- ack --
SELECT fastpubsub.ack(:subscription_id, CAST(:ids AS uuid[])) AS acked

-- nack --
SELECT nacked, dead_lettered FROM fastpubsub.nack(:subscription_id, CAST(:ids AS uuid[]))

-- extend_lease --
SELECT fastpubsub.extend_lease(:subscription_id, CAST(:ids AS uuid[]), :seconds) AS extended

-- list_dlq --
SELECT id, payload, attempts, created_at, attributes, priority
FROM fastpubsub.list_dlq(:subscription_id, :offset, :limit)

-- list_dlq_json --
-- The dead letters as the API's JSON array (the shape consume_json renders).
SELECT coalesce(json_agg(fastpubsub._message_json(
           d.id, :subscription_id, d.payload, d.attempts, d.created_at, d.attributes, d.priority, NULL)
           ORDER BY d.ord), '[]')::text AS data
FROM fastpubsub.list_dlq(:subscription_id, :offset, :limit) WITH ORDINALITY
    AS d(id, payload, attributes, priority, attempts, created_at, ord)

-- reprocess_dlq --
SELECT fastpubsub.reprocess_dlq(:subscription_id, CAST(:ids AS uuid[])) AS reprocessed

-- cleanup_acked --
-- archived_in NULL: whatever the archive holds; otherwise only what that archive holds.
SELECT acked_deleted, messages_deleted
FROM fastpubsub.cleanup_acked(:older_than_seconds, :batch_size, CAST(:archived_in AS text))

-- cleanup_idempotency_keys --
SELECT fastpubsub.cleanup_idempotency_keys(:older_than_seconds, :batch_size) AS deleted

-- cleanup_stuck --
SELECT released, dead_lettered FROM fastpubsub.cleanup_stuck(:lock_timeout_seconds)

-- subscription_metrics --
-- With the counts of messages that expired or were dropped to make room.
SELECT m.available, m.delivered, m.delayed, m.acked, m.dlq, m.oldest_available_age_seconds,
       coalesce(c.expired, 0) AS expired, coalesce(c.dropped, 0) AS dropped
FROM fastpubsub.subscription_metrics(:subscription_id) AS m
JOIN fastpubsub.subscriptions AS s ON s.id = :subscription_id
LEFT JOIN fastpubsub.subscription_counts AS c ON c.subscription_key = s.key

-- all_subscription_metrics --
SELECT s.id AS subscription_id, t.id AS topic_id, m.available, m.delivered, m.delayed, m.acked, m.dlq,
       m.oldest_available_age_seconds, coalesce(c.expired, 0) AS expired, coalesce(c.dropped, 0) AS dropped
FROM fastpubsub.subscriptions AS s
JOIN fastpubsub.topics AS t ON t.key = s.topic_key
CROSS JOIN LATERAL fastpubsub.subscription_metrics(s.id) AS m
LEFT JOIN fastpubsub.subscription_counts AS c ON c.subscription_key = s.key
ORDER BY s.id

-- create_client --
INSERT INTO fastpubsub.clients (id, name, scopes, is_active, secret_hash)
VALUES (:id, :name, :scopes, :is_active, :secret_hash)
RETURNING id, name, scopes, is_active, token_version, created_at, updated_at

-- get_client --
SELECT id, name, scopes, is_active, token_version, created_at, updated_at
FROM fastpubsub.clients WHERE id = :id

-- get_client_credentials --
SELECT id, name, scopes, is_active, token_version, created_at, updated_at, secret_hash
FROM fastpubsub.clients WHERE id = :id

-- list_clients --
SELECT id, name, scopes, is_active, token_version, created_at, updated_at
FROM fastpubsub.clients ORDER BY created_at, id OFFSET :offset LIMIT :limit

-- update_client --
-- is_active NULL keeps the current value.
UPDATE fastpubsub.clients
SET name = :name, scopes = :scopes, is_active = coalesce(CAST(:is_active AS boolean), is_active),
    token_version = token_version + 1, updated_at = now()
WHERE id = :id
RETURNING id, name, scopes, is_active, token_version, created_at, updated_at

-- update_client_secret --
UPDATE fastpubsub.clients
SET secret_hash = :secret_hash, token_version = token_version + 1, updated_at = now()
WHERE id = :id
RETURNING id, name, scopes, is_active, token_version, created_at, updated_at

-- delete_client --
DELETE FROM fastpubsub.clients WHERE id = :id RETURNING id

-- client_token_state --
SELECT is_active, token_version FROM fastpubsub.clients WHERE id = :id

-- next_due --
SELECT fastpubsub.next_due(:subscription_id) AS seconds

-- archive_claim --
-- (Python has no -infinity: NULL stands for it.)
SELECT id, nullif(starts_at, '-infinity') AS starts_at, ends_at, claims
FROM fastpubsub.archive_claim(:destination, :settle_seconds)

-- archive_commit --
SELECT fastpubsub.archive_commit(:batch_id, CAST(:files AS text[]), :messages, :acked_deliveries) AS committed

-- archive_release --
SELECT fastpubsub.archive_release(:batch_id) AS released

-- archive_watermark --
SELECT nullif(fastpubsub.archive_watermark(:destination), '-infinity') AS watermark

-- archive_committed --
-- The committed batches below the watermark that end after :since, oldest first.
SELECT id, nullif(starts_at, '-infinity') AS starts_at, ends_at, files, messages, acked_deliveries
FROM fastpubsub.archive_batches
WHERE destination = :destination AND committed_at IS NOT NULL AND ends_at > :since
  AND ends_at <= fastpubsub.archive_watermark(:destination)
ORDER BY ends_at
