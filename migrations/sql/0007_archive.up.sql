-- The archive's ledger: one row per batch `fastpubsub archive` exports
-- (fastpubsub/sql/schema.sql says what each column holds; the functions that
-- claim and commit batches are in fastpubsub/sql/archive.sql). cleanup_acked
-- gains a third argument, the archive whose watermark it respects; the
-- two-argument form stays, as a wrapper over it, installed from the source.

CREATE TABLE fastpubsub.archive_batches (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    destination text NOT NULL,
    starts_at timestamptz NOT NULL,
    ends_at timestamptz NOT NULL,
    claimed_at timestamptz NOT NULL,
    claims integer NOT NULL DEFAULT 1,
    committed_at timestamptz,
    files text[],
    messages bigint,
    acked_deliveries bigint,
    CONSTRAINT archive_batches_range CHECK (starts_at < ends_at),
    CONSTRAINT archive_batches_destination_starts_at UNIQUE (destination, starts_at)
);
