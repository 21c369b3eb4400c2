-- The provider accounts the live workers can send through, per sender and channel
-- (docs/decisions/0411-a-tenants-own-account-fails-closed.md). Each worker announces its
-- accounts when it starts and then every few seconds, moving `held_until` forward; a row whose
-- `held_until` has passed means no live worker has announced the account since. One row per
-- account, not per worker, so the table stays as small as the configuration and needs no
-- cleanup. A worker routed a delivery to an account it lacks reads this: when a live worker
-- has the account it leaves the delivery `queued` for it; when none has, it gives the
-- delivery back as `retry_wait` (reason `account_unavailable`) until its next look.
CREATE TABLE worker_accounts (
    owner             text NOT NULL CHECK (owner ~ '^[a-z0-9][a-z0-9_-]{0,63}$'),
    channel           text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    provider_account  text NOT NULL CHECK (provider_account ~ '^[a-z0-9][a-z0-9_-]{0,63}$'),
    held_until        timestamptz NOT NULL,
    announced_at      timestamptz NOT NULL,
    PRIMARY KEY (owner, channel, provider_account)
);

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_worker') THEN
        GRANT SELECT, INSERT, UPDATE ON public.worker_accounts TO nudge_worker;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_janitor') THEN
        GRANT SELECT ON public.worker_accounts TO nudge_janitor;
    END IF;
END $$;
