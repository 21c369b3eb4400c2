-- The on-call console, nudge-console (decision 0701): the tokens operators log in with, and
-- the console's own role.
--
-- A token is shown once by `nudgectl console token create` and kept only as its SHA-256 (a
-- token is 32 random bytes: a fast hash is enough, nothing can be guessed from it). It carries
-- a role (`viewer` reads; `operator` may also act), expires, and can be revoked; a revoked or
-- expired token ends the sessions made with it at their next request, and so does a logout
-- (`sessions_valid_after`).
CREATE TABLE public.console_tokens (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name         text NOT NULL CHECK (char_length(name) BETWEEN 1 AND 100),
    role         text NOT NULL CHECK (role IN ('viewer', 'operator')),
    token_sha256 bytea NOT NULL UNIQUE CHECK (octet_length(token_sha256) = 32),
    created_at   timestamptz NOT NULL DEFAULT now(),
    created_by   text NOT NULL CHECK (char_length(created_by) BETWEEN 1 AND 200),
    expires_at   timestamptz NOT NULL,
    revoked_at   timestamptz NULL,
    revoked_by   text NULL,
    -- A session made before this instant is over (a logout moves it: the token's sessions end).
    sessions_valid_after timestamptz NULL,
    CHECK (expires_at > created_at),
    CHECK ((revoked_at IS NULL) = (revoked_by IS NULL))
);

-- The audit log's filters (actor, action, incident), newest first, without a scan of the log.
CREATE INDEX audit_log_actor_at_idx ON public.audit_log (actor, id DESC);
CREATE INDEX audit_log_action_at_idx ON public.audit_log (action, id DESC);
CREATE INDEX audit_log_incident_at_idx ON public.audit_log (incident, id DESC)
    WHERE incident IS NOT NULL;

-- nudge-console connects as `nudge_console`. It reads what its pages show (never a secret:
-- no `tenant_secrets`, no `tenant_webhook_secrets`, and it holds no key to open a sealed
-- destination or content), and writes only what the operator actions it offers write, through
-- the same ledger functions nudgectl calls: a tenant's intake pause (and, on resume, the
-- deliveries of the reminders created during the pause), a channel's drain (and, when it
-- ends, the withheld deliveries), a bucket's rate, and redrives; each with its audit row.
-- Whether a session may act (its token's role) is the console's own check.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_console') THEN
        BEGIN
            CREATE ROLE nudge_console LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'cannot create role nudge_console; create it, then grant as in migration 20261223000001';
        END;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_console') THEN
        REVOKE ALL ON ALL TABLES IN SCHEMA public FROM nudge_console;
        REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM nudge_console;
        REVOKE CREATE ON SCHEMA public FROM nudge_console;
        ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE ALL ON TABLES FROM nudge_console;
        ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE ALL ON SEQUENCES FROM nudge_console;
        GRANT USAGE ON SCHEMA public TO nudge_console;
        -- The pages. Of a reminder, what the trace shows and what materialising it reads:
        -- never its sealed content, its client's correlation id or its request's digest.
        GRANT SELECT ON public.deliveries, public.reminder_revisions,
                        public.tenants, public.tenant_channels, public.channel_controls,
                        public.rate_buckets, public.account_suspensions,
                        public.tenant_bucket_shares, public.dead_letters, public.redrives,
                        public.redrive_items, public.attempts, public.audit_log,
                        public.console_tokens
            TO nudge_console;
        GRANT SELECT (id, tenant_id, event_id, subscriber_ref, channels, scheduled_at,
                      expires_at, cancelled_at, created_at, revision, category)
            ON public.reminders TO nudge_console;
        -- The actions.
        GRANT INSERT ON public.audit_log TO nudge_console;
        GRANT UPDATE (sessions_valid_after) ON public.console_tokens TO nudge_console;
        GRANT UPDATE (intake_paused, intake_paused_at, updated_at) ON public.tenants
            TO nudge_console;
        GRANT UPDATE (draining, drain_incident, drain_started_at, changed_by, changed_at,
                      change_reason)
            ON public.channel_controls TO nudge_console;
        GRANT INSERT, UPDATE ON public.rate_buckets TO nudge_console;
        GRANT INSERT ON public.redrives TO nudge_console;
        GRANT UPDATE (selected, excluded, state, pause_reason, updated_at, running_since,
                      fed_until, canary_passed_at, finished_at)
            ON public.redrives TO nudge_console;
        GRANT INSERT ON public.redrive_items TO nudge_console;
        -- What a resume or the end of a drain materialises: whether each delivery is owed or
        -- suppressed (a contact's digest and opt-out, never its sealed destination).
        GRANT SELECT ON public.run_intents, public.destination_consent,
                        public.subscriber_preferences
            TO nudge_console;
        GRANT SELECT (tenant_id, subscriber_ref, channel, destination_digest, opted_out_at)
            ON public.contacts TO nudge_console;
        GRANT INSERT ON public.deliveries TO nudge_console;
    END IF;
END $$;
