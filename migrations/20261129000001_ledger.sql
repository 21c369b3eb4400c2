-- The send ledger: the one authority on what is owed, in flight, done or dead.
--
-- Channel, state and outcome names are text with CHECK constraints that mirror
-- nudge-domain; a ledger test compares the two sets so they cannot drift.
-- Every timestamp is timestamptz, written by the application from an injected clock.

CREATE TABLE tenants (
    id             uuid PRIMARY KEY,
    name           text NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 200),
    -- Operator flags: a paused tenant gets no new run intents and intake creates no sends.
    intake_paused  boolean NOT NULL DEFAULT false,
    -- Drain for the whole tenant: workers finish only work that is already due.
    draining       boolean NOT NULL DEFAULT false,
    created_at     timestamptz NOT NULL,
    updated_at     timestamptz NOT NULL
);

-- Per tenant and channel: which provider account serves it, and the per-channel drain flag.
CREATE TABLE tenant_channels (
    tenant_id         uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    channel           text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    provider_account  text NULL CHECK (provider_account ~ '^[a-z0-9][a-z0-9_-]{0,63}$'),
    draining          boolean NOT NULL DEFAULT false,
    updated_at        timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, channel)
);

-- When the producer (the clock) materialises a tenant's reminders, and how far ahead.
CREATE TABLE schedules (
    id               uuid PRIMARY KEY,
    tenant_id        uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    cron             text NOT NULL CHECK (length(cron) BETWEEN 1 AND 200),
    -- Each tick materialises the reminders scheduled in [tick, tick + window).
    window_seconds   integer NOT NULL CHECK (window_seconds BETWEEN 1 AND 604800),
    enabled          boolean NOT NULL DEFAULT true,
    created_at       timestamptz NOT NULL,
    UNIQUE (tenant_id, cron)
);

CREATE TABLE reminders (
    id                  uuid PRIMARY KEY,
    tenant_id           uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    -- The client's event id: the same event posted twice is one reminder.
    event_id            text NOT NULL CHECK (length(event_id) BETWEEN 1 AND 200),
    -- Opaque client identifier: sensitive, never logged; resolves to contacts.
    subscriber_ref      text NOT NULL CHECK (length(subscriber_ref) BETWEEN 1 AND 128),
    channels            text[] NOT NULL CHECK (
                            cardinality(channels) BETWEEN 1 AND 3
                            AND channels <@ ARRAY['push', 'email', 'sms']::text[]),
    -- Message content is PHI: stored encrypted like destinations, opened only to send.
    content_ciphertext  bytea NULL,
    scheduled_at        timestamptz NOT NULL,
    expires_at          timestamptz NOT NULL,
    cancelled_at        timestamptz NULL,
    created_at          timestamptz NOT NULL,
    UNIQUE (tenant_id, event_id),
    CHECK (expires_at > scheduled_at)
);
-- The producer's window scan: reminders of one tenant scheduled in a time range.
CREATE INDEX reminders_window_idx ON reminders (tenant_id, scheduled_at) WHERE cancelled_at IS NULL;

-- Destinations (phone, email, push token) exist only here, and only encrypted (AEAD, key
-- outside the database, associated data binding the row's identity so a ciphertext cannot be
-- moved to another subscriber). There is no plaintext destination column anywhere.
CREATE TABLE contacts (
    tenant_id               uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    subscriber_ref          text NOT NULL CHECK (length(subscriber_ref) BETWEEN 1 AND 128),
    channel                 text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    destination_ciphertext  bytea NOT NULL CHECK (length(destination_ciphertext) > 24),
    key_id                  smallint NOT NULL DEFAULT 1,
    updated_at              timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, subscriber_ref, channel)
);

CREATE TABLE deliveries (
    id                   uuid PRIMARY KEY,
    reminder_id          uuid NOT NULL REFERENCES reminders (id) ON DELETE CASCADE,
    tenant_id            uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    channel              text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    state                text NOT NULL CHECK (state IN (
                             'scheduled', 'queued', 'sending', 'retry_wait', 'delivered',
                             'dead_lettered', 'expired', 'ambiguous', 'cancelled')),
    -- Sent on every attempt and redrive; stable for the life of the delivery.
    idempotency_key      text NOT NULL UNIQUE,
    attempt_count        integer NOT NULL DEFAULT 0 CHECK (attempt_count >= 0),
    -- Bumped at every publish: a message carrying an older generation is stale.
    generation           bigint NOT NULL DEFAULT 0 CHECK (generation >= 0),
    lane                 text NOT NULL DEFAULT 'new' CHECK (lane IN ('new', 'retry', 'redrive')),
    scheduled_at         timestamptz NOT NULL,
    expires_at           timestamptz NOT NULL,
    next_attempt_at      timestamptz NULL,
    queued_at            timestamptz NULL,
    lease_owner          text NULL,
    lease_expires_at     timestamptz NULL,
    first_attempt_at     timestamptz NULL,
    last_attempt_at      timestamptz NULL,
    provider_account     text NULL,
    provider_message_id  text NULL,
    last_error_class     text NULL,
    last_error_reason    text NULL,
    -- When the delivery reached a terminal or held state; retention counts from here.
    settled_at           timestamptz NULL,
    created_at           timestamptz NOT NULL,
    updated_at           timestamptz NOT NULL,
    UNIQUE (reminder_id, channel),
    CHECK (expires_at > scheduled_at),
    -- A lease exists exactly while a worker holds the delivery.
    CHECK ((state = 'sending') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    -- Work that waits for its time always knows when that is.
    CHECK (state NOT IN ('scheduled', 'retry_wait', 'queued') OR next_attempt_at IS NOT NULL),
    CHECK ((state IN ('delivered', 'dead_lettered', 'expired', 'cancelled', 'ambiguous'))
           = (settled_at IS NOT NULL))
);

-- "What is due now": the relay's scan, in due order, never touching settled history.
CREATE INDEX deliveries_due_idx ON deliveries (next_attempt_at)
    WHERE state IN ('scheduled', 'retry_wait');
-- "Oldest eligible per channel" and per-channel backlog counts.
CREATE INDEX deliveries_eligible_idx ON deliveries (channel, next_attempt_at)
    WHERE state IN ('scheduled', 'queued', 'retry_wait');
-- Queued work whose message may have been lost, oldest publish first.
CREATE INDEX deliveries_queued_idx ON deliveries (queued_at) WHERE state = 'queued';
-- The expiry sweep: owed work whose time has run out.
CREATE INDEX deliveries_expiry_idx ON deliveries (expires_at)
    WHERE state IN ('scheduled', 'queued', 'retry_wait');
-- The lease reaper.
CREATE INDEX deliveries_lease_idx ON deliveries (lease_expires_at) WHERE state = 'sending';
-- Held for review.
CREATE INDEX deliveries_ambiguous_idx ON deliveries (channel, settled_at) WHERE state = 'ambiguous';
-- Retention, per terminal state.
CREATE INDEX deliveries_settled_idx ON deliveries (state, settled_at)
    WHERE state IN ('delivered', 'dead_lettered', 'expired', 'cancelled');
CREATE INDEX deliveries_reminder_idx ON deliveries (reminder_id);

-- One row per attempt, append-only: the database refuses UPDATE always and DELETE except
-- inside a retention transaction (SET LOCAL nudge.retention = 'on').
CREATE TABLE attempts (
    id                   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    delivery_id          uuid NOT NULL REFERENCES deliveries (id) ON DELETE CASCADE,
    attempt_number       integer NOT NULL CHECK (attempt_number >= 1),
    generation           bigint NOT NULL,
    lane                 text NOT NULL CHECK (lane IN ('new', 'retry', 'redrive')),
    started_at           timestamptz NOT NULL,
    finished_at          timestamptz NOT NULL CHECK (finished_at >= started_at),
    outcome_class        text NOT NULL CHECK (outcome_class IN (
                             'delivered', 'retryable', 'terminal', 'ambiguous')),
    http_status          smallint NULL CHECK (http_status BETWEEN 100 AND 599),
    retry_after_seen     text NULL CHECK (length(retry_after_seen) <= 64),
    retry_after_valid    boolean NOT NULL DEFAULT false,
    delay_chosen_ms      bigint NULL CHECK (delay_chosen_ms >= 0),
    next_state           text NOT NULL CHECK (next_state IN (
                             'scheduled', 'queued', 'sending', 'retry_wait', 'delivered',
                             'dead_lettered', 'expired', 'ambiguous', 'cancelled')),
    next_attempt_at      timestamptz NULL,
    reason               text NULL,
    provider_account     text NULL,
    provider_message_id  text NULL,
    worker               text NULL,
    correlation_id       text NULL,
    UNIQUE (delivery_id, attempt_number)
);

CREATE FUNCTION nudge_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND current_setting('nudge.retention', true) = 'on' THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION '% is append-only: % refused', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'integrity_constraint_violation';
END;
$$;

CREATE TRIGGER attempts_append_only BEFORE UPDATE OR DELETE ON attempts
    FOR EACH ROW EXECUTE FUNCTION nudge_refuse_change();
CREATE TRIGGER attempts_no_truncate BEFORE TRUNCATE ON attempts
    FOR EACH STATEMENT EXECUTE FUNCTION nudge_refuse_change();

-- The clock's memory: one row per (tenant, window); a replayed tick inserts nothing.
CREATE TABLE run_intents (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id           uuid NOT NULL REFERENCES tenants (id) ON DELETE CASCADE,
    window_start        timestamptz NOT NULL,
    window_end          timestamptz NOT NULL,
    deliveries_created  integer NOT NULL CHECK (deliveries_created >= 0),
    created_at          timestamptz NOT NULL,
    UNIQUE (tenant_id, window_start),
    CHECK (window_end > window_start)
);

-- Admission: one bucket per provider account + channel, shared by every replica.
CREATE TABLE rate_buckets (
    provider_account  text NOT NULL CHECK (provider_account ~ '^[a-z0-9][a-z0-9_-]{0,63}$'),
    channel           text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    -- The configured ceiling; 0 stops new sends on this bucket.
    rate_per_second   double precision NOT NULL CHECK (rate_per_second >= 0),
    burst             integer NOT NULL CHECK (burst >= 0),
    -- What 429 feedback currently admits (never above rate_per_second).
    effective_rate    double precision NOT NULL CHECK (effective_rate >= 0),
    paused_until      timestamptz NULL,
    tokens            double precision NOT NULL DEFAULT 0,
    refilled_at       timestamptz NOT NULL,
    changed_by        text NOT NULL,
    changed_at        timestamptz NOT NULL,
    change_reason     text NULL,
    PRIMARY KEY (provider_account, channel),
    CHECK (effective_rate <= rate_per_second)
);

-- Every operator action, append-only like attempts.
CREATE TABLE audit_log (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         timestamptz NOT NULL,
    actor      text NOT NULL CHECK (length(actor) BETWEEN 1 AND 200),
    action     text NOT NULL CHECK (length(action) BETWEEN 1 AND 100),
    target     text NULL,
    reason     text NULL,
    details    jsonb NOT NULL DEFAULT '{}'::jsonb
);
CREATE TRIGGER audit_log_append_only BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION nudge_refuse_change();
CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION nudge_refuse_change();
