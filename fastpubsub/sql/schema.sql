-- fastpubsub: the current tables, types, sequences and indexes.
--
-- This file, the function files beside it and queries.sql are the current
-- definition of everything fastpubsub keeps in PostgreSQL (docs/schema.md
-- explains the layout and how revisions get a database here). Everything lives
-- in the `fastpubsub` schema. Columns are listed in the order the revisions
-- created them, so that a database built from this file and one brought up to
-- date by the revisions are alike, column positions included.

CREATE TYPE fastpubsub.delivery_status AS ENUM ('available', 'scheduled', 'dlq');

CREATE TABLE fastpubsub.topics (
    id text PRIMARY KEY
        CONSTRAINT topics_id_format CHECK (id ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$'),
    -- The hot tables store this 4-byte key rather than the text id.
    key integer GENERATED ALWAYS AS IDENTITY UNIQUE,
    created_at timestamptz NOT NULL DEFAULT now(),
    -- Cleanup deletes the topic's messages once they are this old, delivered
    -- or not (NULL: only the acked-cleanup window applies).
    retention_seconds integer
        CONSTRAINT topics_retention_seconds_range CHECK (retention_seconds BETWEEN 60 AND 315360000),
    -- Whether a subscription of the topic has a max_backlog: publish counts
    -- backlogs only then (kept by the functions that create, change and delete
    -- subscriptions, under the topic's exclusive lock).
    backlog_limited boolean NOT NULL DEFAULT false
);

-- A seed-format filter: top-level field names mapping to lists of allowed
-- values. Defined here because subscriptions.filter_simple is computed by it.
CREATE FUNCTION fastpubsub._filter_is_simple(p_filter jsonb)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT p_filter IS NULL OR (
        jsonb_typeof(p_filter) = 'object'
        AND NOT EXISTS (
            SELECT 1 FROM jsonb_each(p_filter) AS f(key, value)
            WHERE f.key LIKE '$%' OR position('.' IN f.key) > 0 OR jsonb_typeof(f.value) <> 'array'
        )
    )
$$;

CREATE TABLE fastpubsub.subscriptions (
    id text PRIMARY KEY
        CONSTRAINT subscriptions_id_format CHECK (id ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$'),
    key integer GENERATED ALWAYS AS IDENTITY UNIQUE,
    topic_key integer NOT NULL REFERENCES fastpubsub.topics (key) ON DELETE CASCADE,
    filter jsonb,
    max_delivery_attempts integer NOT NULL DEFAULT 5
        CONSTRAINT subscriptions_max_delivery_attempts_range CHECK (max_delivery_attempts BETWEEN 1 AND 1000),
    backoff_min_seconds integer NOT NULL DEFAULT 5
        CONSTRAINT subscriptions_backoff_min_seconds_range CHECK (backoff_min_seconds BETWEEN 0 AND 86400),
    backoff_max_seconds integer NOT NULL DEFAULT 300
        CONSTRAINT subscriptions_backoff_max_seconds_range CHECK (backoff_max_seconds BETWEEN 0 AND 86400),
    ack_deadline_seconds integer NOT NULL DEFAULT 30
        CONSTRAINT subscriptions_ack_deadline_seconds_range CHECK (ack_deadline_seconds BETWEEN 1 AND 3600),
    -- Consume watermark (see _advance_watermark in consume.sql): no live
    -- available delivery of this subscription has seq < consume_from, so
    -- consume seeks straight past the index entries that acked rows leave
    -- behind until VACUUM removes them.
    consume_from bigint NOT NULL DEFAULT 0,
    consume_from_candidate bigint,
    consume_from_candidate_xmax xid8,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    -- While a stream is registered (touch_stream), acks and nacks notify it.
    streaming_until timestamptz,
    -- Seed-format filters take the fast path in publish.
    filter_simple boolean GENERATED ALWAYS AS (fastpubsub._filter_is_simple(filter)) STORED,
    -- The wait before a retry: fixed (backoff_min), linear (backoff_min *
    -- attempts) or exponential (backoff_min * 2^(attempts-1)), capped at
    -- backoff_max; retry_jitter takes up to that fraction off at random.
    retry_policy text NOT NULL DEFAULT 'exponential'
        CONSTRAINT subscriptions_retry_policy_values CHECK (retry_policy IN ('fixed', 'linear', 'exponential')),
    retry_jitter real NOT NULL DEFAULT 0
        CONSTRAINT subscriptions_retry_jitter_range CHECK (retry_jitter BETWEEN 0 AND 1),
    -- Messages older than this are never delivered: dropped or dead-lettered
    -- (expiry_policy) when consume meets them.
    message_ttl_seconds integer
        CONSTRAINT subscriptions_message_ttl_seconds_range CHECK (message_ttl_seconds BETWEEN 1 AND 315360000),
    expiry_policy text NOT NULL DEFAULT 'drop'
        CONSTRAINT subscriptions_expiry_policy_values CHECK (expiry_policy IN ('drop', 'dead_letter')),
    -- Set by publish once a message with its own expiry (ttl_seconds,
    -- expires_at) was routed here: consume then reads messages' expiry.
    expiring_messages boolean NOT NULL DEFAULT false,
    -- Messages waiting, in flight or delayed at most (not dead letters); a
    -- publish beyond it is refused (reject) or makes room (drop_oldest).
    max_backlog integer
        CONSTRAINT subscriptions_max_backlog_range CHECK (max_backlog BETWEEN 1 AND 1000000000),
    backlog_policy text NOT NULL DEFAULT 'reject'
        CONSTRAINT subscriptions_backlog_policy_values CHECK (backlog_policy IN ('reject', 'drop_oldest')),
    -- A subscription created with a start position is filled with the topic's
    -- retained messages in batches (backfill): the next message id to look at,
    -- the id where publish took over, and the oldest publish time wanted.
    -- NULL backfill_next: nothing left to fill.
    backfill_next uuid,
    backfill_until uuid,
    backfill_since timestamptz,
    -- A push subscription: {"endpoint": URL, "headers": {...}, "timeout_seconds": n,
    -- "max_concurrency": n}, delivered by `fastpubsub push-worker` (NULL: pull only).
    push jsonb,
    -- The Standard Webhooks signing secret (whsec_...). HMAC needs the secret
    -- itself, so it is stored as it is: the API shows it only when it is made.
    -- After a rotation the previous one also signs until push_previous_secret_until.
    push_secret text,
    push_previous_secret text,
    push_previous_secret_until timestamptz,
    CONSTRAINT subscriptions_backoff_order CHECK (backoff_max_seconds >= backoff_min_seconds),
    CONSTRAINT subscriptions_push_endpoint CHECK (
        push IS NULL OR coalesce(jsonb_typeof(push) = 'object' AND jsonb_typeof(push -> 'endpoint') = 'string', false)),
    CONSTRAINT subscriptions_push_secret CHECK ((push IS NULL) = (push_secret IS NULL))
);
CREATE INDEX subscriptions_topic_key_idx ON fastpubsub.subscriptions (topic_key);

CREATE TABLE fastpubsub.clients (
    id uuid PRIMARY KEY,
    name text NOT NULL CONSTRAINT clients_name_length CHECK (length(name) BETWEEN 1 AND 200),
    scopes text NOT NULL,
    is_active boolean NOT NULL DEFAULT true,
    secret_hash text NOT NULL,
    -- Carried by every token; changing the client increments it, revoking them.
    token_version integer NOT NULL DEFAULT 1,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Each published payload is stored once, whatever the number of subscriptions.
-- No foreign keys on the hot tables: a foreign key check locks the referenced
-- row for every insert, which makes concurrent publishers queue on the topic.
-- Topic and subscription deletion clean up explicitly instead.
CREATE TABLE fastpubsub.messages (
    created_at timestamptz NOT NULL,
    id uuid NOT NULL,
    topic_key integer NOT NULL,
    -- how many subscriptions the message was routed to when it was published
    fanout integer NOT NULL,
    payload jsonb NOT NULL,
    attributes jsonb,
    priority smallint NOT NULL DEFAULT 0,
    -- A message's own expiry (ttl_seconds or expires_at when published); NULL
    -- costs no space in the row.
    expires_at timestamptz,
    PRIMARY KEY (topic_key, id)
);
-- Reports and retention read messages by time; BRIN costs almost nothing to keep.
CREATE INDEX messages_created_at_brin ON fastpubsub.messages USING brin (created_at);
-- Messages no subscription wanted are kept for the retention window only.
CREATE INDEX messages_unrouted_idx ON fastpubsub.messages (created_at) WHERE fanout = 0;

-- Every entry into the available state draws a new number: the queue order.
-- CACHE 1 (the default) keeps numbers increasing in the order they are drawn,
-- which the consume watermark relies on.
CREATE SEQUENCE fastpubsub.delivery_seq AS bigint CACHE 1;

-- One small row per (subscription, message) until the message is acked.
--   available  deliverable, unless a consumer holds a lease on it (lease_until
--              in the future); a lease that ran out makes it deliverable again
--   scheduled  deliverable from visible_at (retry backoff or delayed publish)
--   dlq        dead-lettered
-- Taking and extending a lease only writes the lease columns, which no index
-- covers, so PostgreSQL updates the row in place (a HOT update: no index
-- writes). The low fillfactor leaves room on each page for that new version.
-- Columns that never change come first so that update records stay small.
CREATE TABLE fastpubsub.deliveries (
    visible_at timestamptz NOT NULL,
    seq bigint NOT NULL,
    message_id uuid NOT NULL,
    subscription_key integer NOT NULL,
    status fastpubsub.delivery_status NOT NULL,
    attempts integer NOT NULL DEFAULT 0,
    lease_until timestamptz,
    leased_at timestamptz,
    consumer_id text,
    priority smallint NOT NULL DEFAULT 0,
    PRIMARY KEY (subscription_key, message_id),
    -- Only available rows carry a lease.
    CONSTRAINT deliveries_lease_only_when_available CHECK (lease_until IS NULL OR status = 'available')
) WITH (
    fillfactor = 40,
    -- acks delete rows all the time: vacuum early and often
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05
);
-- Partial indexes: consume reads only rows it may deliver, an index seek that
-- costs O(batch + leases held) however long the backlog. Highest priority
-- first, queue order (seq) within a priority.
CREATE INDEX deliveries_ready_idx ON fastpubsub.deliveries (subscription_key, priority, seq)
    WHERE status = 'available';
CREATE INDEX deliveries_scheduled_idx ON fastpubsub.deliveries (subscription_key, visible_at)
    WHERE status = 'scheduled';
CREATE INDEX deliveries_dlq_idx ON fastpubsub.deliveries (subscription_key, message_id)
    WHERE status = 'dlq';

-- Acked deliveries leave the hot table and wait here for cleanup_acked: history
-- for reporting and replay that never slows consume down.
CREATE TABLE fastpubsub.acked_deliveries (
    acked_at timestamptz NOT NULL,
    message_id uuid NOT NULL,
    subscription_key integer NOT NULL,
    attempts integer NOT NULL,
    -- When the lease this ack settled was taken (NULL when no lease's ack put
    -- the row here, as with seek): an ack by receipt repeated after it landed
    -- is recognised by it and answered `acknowledged` again.
    leased_at timestamptz,
    PRIMARY KEY (subscription_key, message_id)
);
CREATE INDEX acked_deliveries_acked_at_brin ON fastpubsub.acked_deliveries USING brin (acked_at);

-- Counters of a subscription, one row each, written only when the options
-- they count are in use: the backlog (maintained while max_backlog is set, so
-- that publish never counts rows), and the messages that expired (TTL,
-- retention) or were dropped to make room (drop_oldest).
CREATE TABLE fastpubsub.subscription_counts (
    subscription_key integer PRIMARY KEY,
    backlog bigint NOT NULL DEFAULT 0,
    expired bigint NOT NULL DEFAULT 0,
    dropped bigint NOT NULL DEFAULT 0
);

-- A repeated idempotency key on a topic returns the original message id.
CREATE TABLE fastpubsub.idempotency_keys (
    topic_key integer NOT NULL,
    key text NOT NULL,
    message_id uuid NOT NULL,
    created_at timestamptz NOT NULL,
    PRIMARY KEY (topic_key, key)
);
CREATE INDEX idempotency_keys_created_at_brin ON fastpubsub.idempotency_keys USING brin (created_at);

-- One row per batch `fastpubsub archive` exports to a destination (a directory
-- or URI): the messages created and the acked deliveries acked in
-- [starts_at, ends_at). A destination's batches follow each other without gap
-- or overlap (archive_claim draws the next one under a lock); a batch's rows
-- are in the archive once committed_at is set, and `files` lists its files
-- there. The end of the committed prefix is the destination's watermark
-- (archive_watermark), which cleanup_acked can be told to respect.
CREATE TABLE fastpubsub.archive_batches (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    destination text NOT NULL,
    starts_at timestamptz NOT NULL,
    ends_at timestamptz NOT NULL,
    claimed_at timestamptz NOT NULL,
    -- how many runs have claimed the batch (more than 1: a run stopped and another took it over)
    claims integer NOT NULL DEFAULT 1,
    committed_at timestamptz,
    files text[],
    messages bigint,
    acked_deliveries bigint,
    CONSTRAINT archive_batches_range CHECK (starts_at < ends_at),
    CONSTRAINT archive_batches_destination_starts_at UNIQUE (destination, starts_at)
);
