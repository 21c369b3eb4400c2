-- Paced redrive of dead-lettered work, and the incident an attempt was made under.
--
-- A redrive is a change with a budget: `nudgectl redrive --execute` freezes the deliveries it
-- selected as numbered items, and the janitor feeds them back one rate's worth at a time (a
-- fed delivery is `retry_wait` in the `redrive` lane with its original id, key and attempt
-- history). The pacing state lives here, so any janitor replica can carry on after a crash.

CREATE TABLE redrives (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    channel          text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    -- Filters as given (NULL: not filtered).
    tenant_id        uuid NULL REFERENCES tenants (id) ON DELETE RESTRICT,
    max_age_s        bigint NULL CHECK (max_age_s > 0),
    max_deliveries   integer NULL CHECK (max_deliveries > 0),
    rate_per_second  double precision NOT NULL CHECK (rate_per_second > 0 AND rate_per_second <= 1000000),
    -- Feed this many first; go on only once they settled without a 429 or a 5xx.
    canary           integer NULL CHECK (canary > 0),
    canary_passed_at timestamptz NULL,
    state            text NOT NULL CHECK (state IN ('running', 'paused', 'finished', 'cancelled')),
    -- Counts when it was executed: selected, and excluded by reason.
    selected         integer NOT NULL CHECK (selected >= 0),
    excluded         jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- Progress: items fed back, items skipped at their turn (expired, tenant paused, moved on).
    fed              integer NOT NULL DEFAULT 0 CHECK (fed >= 0),
    skipped          integer NOT NULL DEFAULT 0 CHECK (skipped >= 0),
    -- Pacing: the next item is due at fed_until + 1 / rate (no credit builds up while paused).
    fed_until        timestamptz NOT NULL,
    -- When it last started or resumed: its auto-pause looks at attempts since then only.
    running_since    timestamptz NOT NULL,
    pause_reason     text NULL CHECK (length(pause_reason) <= 500),
    actor            text NOT NULL CHECK (length(actor) BETWEEN 1 AND 200),
    reason           text NOT NULL CHECK (length(reason) BETWEEN 1 AND 1000),
    incident         text NULL CHECK (length(incident) BETWEEN 1 AND 100),
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    finished_at      timestamptz NULL,
    CHECK (fed + skipped <= selected),
    CHECK ((state IN ('finished', 'cancelled')) = (finished_at IS NOT NULL))
);
-- One active redrive per channel: two would add their rates without anyone choosing the sum.
CREATE UNIQUE INDEX redrives_one_active_idx ON redrives (channel)
    WHERE state IN ('running', 'paused');

CREATE TABLE redrive_items (
    redrive_id     bigint NOT NULL REFERENCES redrives (id) ON DELETE RESTRICT,
    position       integer NOT NULL CHECK (position >= 1),
    delivery_id    uuid NOT NULL REFERENCES deliveries (id) ON DELETE RESTRICT,
    fed_at         timestamptz NULL,
    skipped_reason text NULL CHECK (length(skipped_reason) <= 100),
    PRIMARY KEY (redrive_id, position),
    UNIQUE (redrive_id, delivery_id),
    CHECK (fed_at IS NULL OR skipped_reason IS NULL)
);
CREATE INDEX redrive_items_pending_idx ON redrive_items (redrive_id, position)
    WHERE fed_at IS NULL AND skipped_reason IS NULL;
CREATE INDEX redrive_items_delivery_idx ON redrive_items (delivery_id);

-- The retry policy's attempt limit counts from the last redrive: a redriven delivery gets a
-- fresh budget of attempts while its attempt numbers (and history) carry on.
ALTER TABLE deliveries
    ADD COLUMN attempt_base integer NOT NULL DEFAULT 0 CHECK (attempt_base >= 0),
    ADD CONSTRAINT deliveries_attempt_base_within CHECK (attempt_base <= attempt_count);

-- The incident an attempt was made under (a redrive's or a drain's), for the incident export.
ALTER TABLE attempts
    ADD COLUMN incident text NULL CHECK (length(incident) BETWEEN 1 AND 100);

-- Recent attempts per channel: the redrive's 429 ratio and the observed successful rate.
CREATE INDEX attempts_finished_idx ON attempts (finished_at);

-- The incident an operator acted under (`--incident ID` on nudgectl's changes).
ALTER TABLE audit_log
    ADD COLUMN incident text NULL CHECK (length(incident) BETWEEN 1 AND 100);

-- A redrive's record is evidence of an operator change: never truncated away.
CREATE TRIGGER redrives_no_truncate BEFORE TRUNCATE ON redrives
    FOR EACH STATEMENT EXECUTE FUNCTION nudge_refuse_change();
CREATE TRIGGER redrive_items_no_truncate BEFORE TRUNCATE ON redrive_items
    FOR EACH STATEMENT EXECUTE FUNCTION nudge_refuse_change();
