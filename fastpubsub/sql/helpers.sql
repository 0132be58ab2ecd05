-- Private helpers shared by the broker functions (names start with `_`).
--
-- Errors raised by fastpubsub's functions use SQLSTATEs of their own, so that
-- callers tell them apart without parsing messages: FP404 not found, FP422
-- invalid input.

-- Time-ordered message ids in the UUIDv7 layout: 48 bits of Unix milliseconds,
-- 12 bits of sub-millisecond time (1/4096 ms), 62 random bits. `p_offset` adds
-- that many 1/4096 ms steps so that messages of one publish keep their order.
-- One expression with no FROM clause, so the planner inlines it into publish
-- instead of planning it again in every transaction.
CREATE OR REPLACE FUNCTION fastpubsub._message_id(p_time timestamptz, p_offset bigint)
RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$
    SELECT encode(
        substring(int8send(((extract(epoch FROM p_time) * 4096000)::bigint + p_offset) >> 12) FROM 3 FOR 6)
        || substring(int4send(((((extract(epoch FROM p_time) * 4096000)::bigint + p_offset) & 4095) | 28672)::integer)
                     FROM 3 FOR 2)
        || substring(uuid_send(gen_random_uuid()) FROM 9 FOR 8),
        'hex')::uuid
$$;

-- The smallest message id that can belong to a message published at p_time:
-- a time bound becomes an id bound (replay and cleanup_stuck read only the
-- part of a backlog they need). Ids count from 1970: a time before that is
-- the smallest id of all (a negative count would make the largest); one from
-- the year 10000 on (infinity too) is past any id a message can have.
CREATE OR REPLACE FUNCTION fastpubsub._message_id_floor(p_time timestamptz)
RETURNS uuid
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT encode(
        substring(int8send(t.units >> 12) FROM 3 FOR 6)
        || substring(int4send(((t.units & 4095) | 28672)::integer) FROM 3 FOR 2)
        || '\x0000000000000000'::bytea,
        'hex')::uuid
    FROM (SELECT floor(extract(epoch FROM least(greatest(p_time, 'epoch'::timestamptz),
                                                '10000-01-01 00:00:00+00'::timestamptz)) * 4096000)::bigint
                 AS units) AS t
$$;

-- A message as consumers receive it: the one definition of its JSON shape,
-- used by consume, streams and the DLQ listing (api/schemas.py MessageOut
-- documents it). Times are UTC with microseconds. PostgreSQL renders any
-- depth of nesting the payload was stored with. `receipt` names this
-- delivery's lease (NULL outside a lease, as in the DLQ).
CREATE OR REPLACE FUNCTION fastpubsub._message_json(
    p_id uuid, p_subscription_id text, p_payload jsonb, p_attempts integer, p_created_at timestamptz,
    p_attributes jsonb, p_priority smallint, p_receipt text)
RETURNS json
LANGUAGE sql STABLE PARALLEL SAFE
AS $$
    SELECT json_build_object(
        'id', p_id,
        'subscription_id', p_subscription_id,
        'payload', p_payload,
        'delivery_attempts', p_attempts,
        'created_at', to_char(p_created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
        'attributes', p_attributes,
        'priority', p_priority,
        'receipt', p_receipt)
$$;

-- Microseconds since the Unix epoch: how receipts name the time a lease was taken.
-- Read from the interval since the epoch, not from the time itself: extract
-- from a timestamptz is STABLE (other fields depend on the time zone), and an
-- IMMUTABLE function whose body calls a STABLE one is never inlined, so each
-- leased message paid a call of its own (the same value: an interval's epoch
-- counts its days and time exactly).
CREATE OR REPLACE FUNCTION fastpubsub._micros(p_time timestamptz)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT (extract(epoch FROM p_time - timestamptz '1970-01-01 00:00:00+00') * 1000000)::bigint
$$;

-- A lease receipt: the message id and the time its lease was taken, 24 bytes
-- in URL-safe base64 (32 characters). Each lease of a delivery gets a new
-- receipt; settling with a receipt acts only on that lease, so a consumer
-- cannot settle a lease someone else took after its own ran out.
CREATE OR REPLACE FUNCTION fastpubsub._receipt(p_id uuid, p_leased_at timestamptz)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT translate(encode(uuid_send(p_id) || int8send(fastpubsub._micros(p_leased_at)), 'base64'), '+/', '-_')
$$;

-- The lease a receipt names: its message and when the lease was taken
-- (NULLs for anything that is not a receipt).
CREATE OR REPLACE FUNCTION fastpubsub._receipt_lease(
    p_receipt text, OUT message_id uuid, OUT leased_micros bigint)
RETURNS record
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
AS $$
DECLARE
    v_bytes bytea;
BEGIN
    IF p_receipt IS NULL OR p_receipt !~ '^[A-Za-z0-9_-]{32}$' THEN
        RETURN;
    END IF;
    v_bytes := decode(translate(p_receipt, '-_', '+/'), 'base64');
    message_id := encode(substring(v_bytes FROM 1 FOR 16), 'hex')::uuid;
    leased_micros := ('x' || encode(substring(v_bytes FROM 17 FOR 8), 'hex'))::bit(64)::bigint;
END
$$;

-- The subscription row, or FP404.
CREATE OR REPLACE FUNCTION fastpubsub._subscription(p_subscription_id text)
RETURNS fastpubsub.subscriptions
LANGUAGE plpgsql STABLE
AS $$
DECLARE
    s fastpubsub.subscriptions;
BEGIN
    SELECT * INTO s FROM fastpubsub.subscriptions WHERE id = p_subscription_id;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'subscription "%" not found', p_subscription_id USING ERRCODE = 'FP404';
    END IF;
    RETURN s;
END
$$;

-- Publishers take this lock shared and topic or subscription changes take it
-- exclusive, so a publish never fans out to a subscription being deleted.
-- (_publish takes the shared lock itself, written out: keep the two alike.)
CREATE OR REPLACE FUNCTION fastpubsub._lock_topic(p_topic_key integer, p_exclusive boolean)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    -- 1718645602 is 'fpsb': our own advisory lock namespace.
    IF p_exclusive THEN
        PERFORM pg_advisory_xact_lock(1718645602, p_topic_key);
    ELSE
        PERFORM pg_advisory_xact_lock_shared(1718645602, p_topic_key);
    END IF;
END
$$;

-- Wake long-poll and streaming consumers: one notification on the
-- `fastpubsub` channel, sent when the transaction commits, naming each
-- subscription with how many messages it can now deliver (`orders=3`; 0 when
-- only a due time changed; `settled:orders=2` for acks and nacks that may
-- make room in a full stream).
--
-- The server's own sessions set fastpubsub.notify = off: they wake this
-- process's waiters after the commit and tell other processes with one
-- coalesced notification outside the data transaction, because notifying
-- transactions commit one at a time on a global lock. Sessions of
-- applications publishing inside their own transactions keep notifying.
CREATE OR REPLACE FUNCTION fastpubsub._notify(p_names text[], p_counts integer[])
RETURNS void
LANGUAGE plpgsql
AS $$
DECLARE
    v_payload text;
BEGIN
    IF cardinality(p_names) IS NULL OR cardinality(p_names) = 0
       OR current_setting('fastpubsub.notify', true) = 'off' THEN
        RETURN;
    END IF;
    SELECT string_agg(n.name || '=' || coalesce(n.count, 0), ' ') INTO v_payload
    FROM unnest(p_names, p_counts) AS n(name, count);
    IF octet_length(v_payload) > 7000 THEN
        v_payload := '*';  -- too many to list: every waiter looks for itself
    END IF;
    PERFORM pg_notify('fastpubsub', v_payload);
END
$$;

-- The highest priority below p_below (NULL: any) that has available rows: a
-- loose index scan, one seek per priority present. PL/pgSQL, so its plan is
-- kept for the life of the connection.
CREATE OR REPLACE FUNCTION fastpubsub._next_priority(p_subscription_key integer, p_below smallint)
RETURNS smallint
LANGUAGE plpgsql STABLE
SET enable_sort = off
SET enable_bitmapscan = off
SET jit = off
AS $$
BEGIN
    RETURN (
        SELECT d.priority FROM fastpubsub.deliveries AS d
        WHERE d.subscription_key = p_subscription_key AND d.status = 'available'
          AND d.priority < coalesce(p_below, 32767)  -- a range the index seeks to, never a filter
        ORDER BY d.priority DESC
        LIMIT 1);
END
$$;

-- Where the current leases of these message ids are: one primary-key probe
-- per id. (As a join, the planner may instead walk every delivery of the
-- subscription when its statistics call the table small.) A lease that has
-- run out is not counted: the message is no longer that consumer's.
CREATE OR REPLACE FUNCTION fastpubsub._held(p_subscription_key integer, p_ids uuid[])
RETURNS tid[]
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    RETURN (
        SELECT coalesce(array_agg(h.row_id), '{}')
        FROM unnest(p_ids) AS x(id)
        CROSS JOIN LATERAL (
            SELECT d.ctid AS row_id FROM fastpubsub.deliveries AS d
            WHERE d.subscription_key = p_subscription_key AND d.message_id = x.id AND d.lease_until > now()
            LIMIT 1
        ) AS h);
END
$$;

-- Add to a subscription's counters (subscription_counts): its backlog (only
-- while it has a max_backlog: callers check, so that subscriptions without one
-- never write here), messages expired and messages dropped to make room.
CREATE OR REPLACE FUNCTION fastpubsub._count(
    p_subscription_key integer, p_backlog bigint, p_expired bigint, p_dropped bigint)
RETURNS void
LANGUAGE plpgsql
AS $$
BEGIN
    IF p_backlog = 0 AND p_expired = 0 AND p_dropped = 0 THEN
        RETURN;
    END IF;
    INSERT INTO fastpubsub.subscription_counts AS c (subscription_key, backlog, expired, dropped)
    VALUES (p_subscription_key, p_backlog, p_expired, p_dropped)
    ON CONFLICT (subscription_key) DO UPDATE
    SET backlog = c.backlog + excluded.backlog,
        expired = c.expired + excluded.expired,
        dropped = c.dropped + excluded.dropped;
END
$$;

-- The same for several subscriptions at once, in key order, so that two
-- transactions counting for the same subscriptions never wait for each other
-- in a cycle. Entries of one key are added up.
CREATE OR REPLACE FUNCTION fastpubsub._count_all(
    p_subscription_keys integer[], p_backlog bigint[], p_expired bigint[], p_dropped bigint[])
RETURNS void
LANGUAGE sql
AS $$
    INSERT INTO fastpubsub.subscription_counts AS c (subscription_key, backlog, expired, dropped)
    SELECT x.key, sum(x.backlog), sum(x.expired), sum(x.dropped)
    FROM unnest(p_subscription_keys, p_backlog, p_expired, p_dropped) AS x(key, backlog, expired, dropped)
    WHERE x.key IS NOT NULL
    GROUP BY x.key
    HAVING sum(x.backlog) <> 0 OR sum(x.expired) <> 0 OR sum(x.dropped) <> 0
    ORDER BY x.key
    ON CONFLICT (subscription_key) DO UPDATE
    SET backlog = c.backlog + excluded.backlog,
        expired = c.expired + excluded.expired,
        dropped = c.dropped + excluded.dropped
$$;

-- Take the rows at p_rows (locked by the caller, of subscription s) out as
-- expired: deleted (expiry_policy drop; their messages go once nothing else
-- refers to them) or dead-lettered. Counts them; returns how many.
CREATE OR REPLACE FUNCTION fastpubsub._expire_rows(s fastpubsub.subscriptions, p_rows tid[])
RETURNS integer
LANGUAGE plpgsql
AS $$
DECLARE
    v_ids uuid[];
BEGIN
    IF cardinality(p_rows) = 0 THEN
        RETURN 0;
    END IF;
    IF s.expiry_policy = 'dead_letter' THEN
        WITH dead AS (
            UPDATE fastpubsub.deliveries AS d
            SET status = 'dlq', visible_at = now(), lease_until = NULL, leased_at = NULL, consumer_id = NULL
            WHERE d.ctid = ANY (p_rows)
            RETURNING d.message_id
        )
        SELECT coalesce(array_agg(message_id), '{}') INTO v_ids FROM dead;
    ELSE
        WITH gone AS (
            DELETE FROM fastpubsub.deliveries AS d WHERE d.ctid = ANY (p_rows) RETURNING d.message_id
        )
        SELECT coalesce(array_agg(message_id), '{}') INTO v_ids FROM gone;
        PERFORM fastpubsub._delete_orphan_messages(array_fill(s.topic_key, ARRAY[cardinality(v_ids)]), v_ids);
    END IF;
    PERFORM fastpubsub._count(
        s.key, CASE WHEN s.max_backlog IS NOT NULL THEN -cardinality(v_ids) ELSE 0 END, cardinality(v_ids), 0);
    RETURN cardinality(v_ids);
END
$$;
