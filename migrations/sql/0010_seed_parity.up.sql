-- What the peer brokers offer (fastpubsub/sql/schema.sql says what each
-- column holds; the functions come from fastpubsub/sql at the head):
-- * topics: retention_seconds (cleanup deletes older messages) and
--   backlog_limited (publish counts backlogs only on such topics);
-- * subscriptions: retry_policy and retry_jitter, message_ttl_seconds and
--   expiry_policy, expiring_messages, max_backlog and backlog_policy, and the
--   backfill cursor of a subscription created with a start position;
-- * messages: expires_at, a message's own expiry (NULL takes no room);
-- * subscription_counts: backlog, expired and dropped, per subscription.
-- deliveries, written on every publish and lease, gains nothing.
-- create_subscription and update_subscription gain option-object forms; the
-- positional ones stay as wrappers (compat.sql).

ALTER TABLE fastpubsub.topics
    ADD COLUMN retention_seconds integer
        CONSTRAINT topics_retention_seconds_range CHECK (retention_seconds BETWEEN 60 AND 315360000),
    ADD COLUMN backlog_limited boolean NOT NULL DEFAULT false;

ALTER TABLE fastpubsub.subscriptions
    ADD COLUMN retry_policy text NOT NULL DEFAULT 'exponential'
        CONSTRAINT subscriptions_retry_policy_values CHECK (retry_policy IN ('fixed', 'linear', 'exponential')),
    ADD COLUMN retry_jitter real NOT NULL DEFAULT 0
        CONSTRAINT subscriptions_retry_jitter_range CHECK (retry_jitter BETWEEN 0 AND 1),
    ADD COLUMN message_ttl_seconds integer
        CONSTRAINT subscriptions_message_ttl_seconds_range CHECK (message_ttl_seconds BETWEEN 1 AND 315360000),
    ADD COLUMN expiry_policy text NOT NULL DEFAULT 'drop'
        CONSTRAINT subscriptions_expiry_policy_values CHECK (expiry_policy IN ('drop', 'dead_letter')),
    ADD COLUMN expiring_messages boolean NOT NULL DEFAULT false,
    ADD COLUMN max_backlog integer
        CONSTRAINT subscriptions_max_backlog_range CHECK (max_backlog BETWEEN 1 AND 1000000000),
    ADD COLUMN backlog_policy text NOT NULL DEFAULT 'reject'
        CONSTRAINT subscriptions_backlog_policy_values CHECK (backlog_policy IN ('reject', 'drop_oldest')),
    ADD COLUMN backfill_next uuid,
    ADD COLUMN backfill_until uuid,
    ADD COLUMN backfill_since timestamptz;

ALTER TABLE fastpubsub.messages ADD COLUMN expires_at timestamptz;

CREATE TABLE fastpubsub.subscription_counts (
    subscription_key integer PRIMARY KEY,
    backlog bigint NOT NULL DEFAULT 0,
    expired bigint NOT NULL DEFAULT 0,
    dropped bigint NOT NULL DEFAULT 0
);
