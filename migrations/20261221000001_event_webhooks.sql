-- Delivery events pushed to each tenant's endpoint (decision 0602): where the endpoint is, the
-- secrets its requests are signed with (Standard Webhooks), and how far it has acknowledged.
-- `nudge-events` reads the tenant's numbered events after `acked_position`, POSTs them as one
-- batch and moves `acked_position` only on a 2xx: at least once, in position order.

CREATE TABLE tenant_webhooks (
    tenant_id         uuid PRIMARY KEY REFERENCES tenants (id) ON DELETE RESTRICT,
    -- Checked by `nudgectl tenant webhook set` (https, or http where allowed, no credentials);
    -- the address it resolves to is decided at each request by nudge-events.
    url               text NOT NULL CHECK (url ~ '^https?://' AND length(url) <= 2048),
    enabled           boolean NOT NULL DEFAULT true,
    -- The last position the endpoint answered 2xx for: the push resumes after it.
    acked_position    bigint NOT NULL DEFAULT 0 CHECK (acked_position >= 0),
    -- The last position of a batch that failed: its retry is the same batch (same events, same
    -- webhook-id) until a 2xx acknowledges it.
    pending_through   bigint NULL CHECK (pending_through IS NULL OR pending_through > acked_position),
    failures          integer NOT NULL DEFAULT 0 CHECK (failures >= 0),
    failing_since     timestamptz NULL,
    next_attempt_at   timestamptz NOT NULL DEFAULT now(),
    last_error        text NULL CHECK (length(last_error) <= 500),
    disabled_at       timestamptz NULL,
    -- Who disabled it: nudge-events, after it failed for events.disable_after_s (alerted), or
    -- an operator (`nudgectl tenant webhook disable`).
    disabled_by       text NULL CHECK (disabled_by IN ('failing', 'operator')),
    disabled_reason   text NULL CHECK (length(disabled_reason) <= 500),
    -- The lease of the nudge-events task pushing this tenant's events (a token made at each
    -- claim), and until when (renewed before each batch is sent): one task per tenant at a
    -- time, so batches stay in order, and a task whose lease was taken over sends nothing more.
    lease_owner       uuid NULL,
    lease_until       timestamptz NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    CHECK (enabled = (disabled_at IS NULL) AND enabled = (disabled_by IS NULL))
);

-- The signing secrets (`whsec_` and base64 of 32 random bytes), sealed like the intake's
-- (crypto.tenant_secret_key, else crypto.destination_key; the associated data names the
-- tenant, the generation and that it is a webhook secret). A rotation adds a generation and
-- gives the older one an end (`retires_at`): until then each request carries both
-- signatures, so a client can switch secrets without missing a batch.
CREATE TABLE tenant_webhook_secrets (
    tenant_id          uuid NOT NULL REFERENCES tenant_webhooks (tenant_id) ON DELETE CASCADE,
    generation         integer NOT NULL CHECK (generation >= 1),
    secret_ciphertext  bytea NOT NULL,
    sealed_with        text NOT NULL CHECK (sealed_with IN ('destination_key', 'tenant_secret_key')),
    created_at         timestamptz NOT NULL DEFAULT now(),
    retires_at         timestamptz NULL,
    PRIMARY KEY (tenant_id, generation)
);

-- nudge-events connects as `nudge_events`: it reads the numbered events, the webhooks and
-- their secrets, and updates only the push's own columns of a webhook (never its URL).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_events') THEN
        BEGIN
            CREATE ROLE nudge_events LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE NOTICE 'cannot create role nudge_events; create it, then grant as in migration 20261221000001';
        END;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_events') THEN
        REVOKE ALL ON ALL TABLES IN SCHEMA public FROM nudge_events;
        REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM nudge_events;
        REVOKE CREATE ON SCHEMA public FROM nudge_events;
        GRANT USAGE ON SCHEMA public TO nudge_events;
        GRANT SELECT ON public.delivery_events TO nudge_events;
        GRANT SELECT ON public.tenant_webhooks TO nudge_events;
        GRANT UPDATE (enabled, acked_position, pending_through, failures, failing_since,
                      next_attempt_at, last_error, disabled_at, disabled_by, disabled_reason,
                      lease_owner, lease_until, updated_at)
            ON public.tenant_webhooks TO nudge_events;
        GRANT SELECT ON public.tenant_webhook_secrets TO nudge_events;
        GRANT EXECUTE ON FUNCTION public.nudge_ledger_observe() TO nudge_events;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_janitor') THEN
        GRANT SELECT ON public.tenant_webhooks TO nudge_janitor;
    END IF;
END $$;
