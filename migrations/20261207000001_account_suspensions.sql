-- A provider account without a rate bucket (no configured rate: not limited) can still be
-- suspended when its provider refuses its credentials (or an answer is read as its
-- misconfiguration). The suspension of an account with a bucket pauses the bucket; one without
-- is kept here, per account and channel, and the lease's admission gives the account's
-- deliveries back unsent, due at its end, without spending an attempt. A row whose end has
-- passed has no effect; the next suspension overwrites it.
CREATE TABLE account_suspensions (
    provider_account  text NOT NULL CHECK (provider_account ~ '^[a-z0-9][a-z0-9_-]{0,63}$'),
    channel           text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    suspended_until   timestamptz NOT NULL,
    cause             text NOT NULL CHECK (length(cause) BETWEEN 1 AND 200),
    suspended_at      timestamptz NOT NULL,
    PRIMARY KEY (provider_account, channel)
);
