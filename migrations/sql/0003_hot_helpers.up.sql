-- Hot-path helpers whose plans survive the transaction.
--
-- A LANGUAGE sql function that cannot be inlined (it has a FROM clause or SET
-- options) is parsed and planned again in every transaction that calls it:
-- 80-120 microseconds each time, several times per publish, consume, ack and
-- long-poll. The helpers below are either a single expression, which the
-- planner inlines into the calling query, or PL/pgSQL, whose plans are kept
-- for the life of the connection. Behaviour is unchanged.

-- Inlined into publish: one expression, no FROM clause.
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

CREATE OR REPLACE FUNCTION fastpubsub._next_priority(p_subscription_key integer, p_below smallint)
RETURNS smallint
LANGUAGE plpgsql STABLE
SET enable_sort = off
SET enable_bitmapscan = off
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
            WHERE d.subscription_key = p_subscription_key AND d.message_id = x.id AND d.lease_until IS NOT NULL
            LIMIT 1
        ) AS h);
END
$$;

-- consume (the first revision's signature, still part of the SQL interface) had
-- lost its index when revision 0002 replaced deliveries_available_idx with the
-- priority index, and sorted the whole backlog on every call. It now leases
-- through consume_v2: the same index seek, priorities and scheduled retries.
CREATE OR REPLACE FUNCTION fastpubsub.consume(p_subscription_id text, p_consumer_id text, p_batch_size integer)
RETURNS TABLE (id uuid, payload jsonb, attempts integer, created_at timestamptz)
LANGUAGE sql
AS $$
    SELECT c.id, c.payload, c.attempts, c.created_at
    FROM fastpubsub.consume_v2(p_subscription_id, p_consumer_id, p_batch_size) WITH ORDINALITY
        AS c(id, payload, attributes, priority, attempts, created_at, ord)
    ORDER BY c.ord
$$;
