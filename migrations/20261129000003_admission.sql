-- Admission control: the rate bucket of a provider account + channel holds GCRA state
-- (theoretical arrival times), lane reserves and the 429 feedback history, shared by all
-- worker replicas through a row lock. See nudge_domain::admission.

ALTER TABLE rate_buckets
    DROP COLUMN tokens,
    DROP COLUMN refilled_at,
    -- Share of the rate kept for new work while recovery (retry, redrive) also waits, and the
    -- share kept for recovery while new work also waits.
    ADD COLUMN reserve_new double precision NOT NULL DEFAULT 0.2
        CHECK (reserve_new >= 0 AND reserve_new < 1),
    ADD COLUMN reserve_recovery double precision NOT NULL DEFAULT 0.1
        CHECK (reserve_recovery >= 0 AND reserve_recovery < 1),
    ADD COLUMN tat timestamptz NULL,
    ADD COLUMN tat_new timestamptz NULL,
    ADD COLUMN tat_recovery timestamptz NULL,
    ADD COLUMN new_demand_at timestamptz NULL,
    ADD COLUMN recovery_demand_at timestamptz NULL,
    ADD COLUMN last_decrease_at timestamptz NULL,
    ADD COLUMN last_increase_at timestamptz NULL,
    ADD CONSTRAINT rate_buckets_reserves CHECK (reserve_new + reserve_recovery < 1),
    ADD CONSTRAINT rate_buckets_burst CHECK (burst >= 1 OR rate_per_second = 0);

-- The relay claims due work per channel, so one channel's backlog never delays another's.
CREATE INDEX deliveries_due_channel_idx ON deliveries (channel, next_attempt_at)
    WHERE state IN ('scheduled', 'retry_wait');
