-- The delivery pipeline: what the lease reaper and the dead-letter recorder need.

-- Whether the provider account a worker was sending through honours idempotency keys,
-- written with the lease. When a lease expires without an outcome, the reaper retries the
-- delivery only if a resend is safe (the key dedupes it); otherwise it is held as ambiguous.
ALTER TABLE deliveries ADD COLUMN lease_idempotent boolean NULL;

-- Messages that reached a dead-letter queue, as recorded by the janitor. A queue message
-- carries ids only (never a destination or content), so its bytes are kept for inspection,
-- capped in size.
CREATE TABLE dead_letters (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue           text NOT NULL,
    channel         text NULL CHECK (channel IN ('push', 'email', 'sms')),
    -- Why RabbitMQ dead-lettered it (x-death reason: rejected, delivery_limit, ...).
    death_reason    text NOT NULL,
    -- Why nudge could not use it, when the envelope did not decode.
    decode_error    text NULL,
    delivery_id     uuid NULL,
    generation      bigint NULL,
    delivery_count  bigint NOT NULL DEFAULT 0,
    payload         bytea NOT NULL CHECK (length(payload) <= 4096),
    payload_size    integer NOT NULL CHECK (payload_size >= 0),
    -- What the recorder did with the delivery it pointed at, if anything.
    action          text NOT NULL,
    recorded_at     timestamptz NOT NULL
);
CREATE INDEX dead_letters_recorded_idx ON dead_letters (recorded_at);
CREATE INDEX dead_letters_delivery_idx ON dead_letters (delivery_id) WHERE delivery_id IS NOT NULL;
