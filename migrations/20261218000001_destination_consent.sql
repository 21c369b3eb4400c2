-- Consent of a destination, and its history (docs/decisions/0505-a-stop-is-kept-by-the-destination.md).
--
-- `destination_consent` holds, per tenant, channel and destination, whether the destination
-- may be reached: keyed by the destination's keyed digest (`contacts.destination_digest`'s
-- HMAC under the subscriber key over the tenant, the channel and the destination's normal
-- form), never by the destination itself. It belongs to no subscriber: the same number posted
-- again later, for any subscriber of the tenant, after an erasure or under a new reference,
-- meets the same row and stays opted out until it opts back in. Rows are never deleted (a
-- trigger refuses DELETE and TRUNCATE); an opt-in is a state, not a removal.
--
-- Each row carries its last change (source, actor, keyword as received, correlation id,
-- provider event, the database's time); a trigger appends every insert and update to
-- `consent_history`, so no path can change consent without its entry. `consent_history` is
-- append-only: a trigger refuses UPDATE, DELETE and TRUNCATE.
--
-- Who writes: the worker (a provider's answer that the recipient opted out, 21610), the
-- intake (a delivery receipt's unsubscribe; an inbound STOP or START keyword). The lease and
-- the fence read it before every send.
--
-- Contacts flagged opted out before this migration (`contacts.opted_out_at`) are carried over
-- when their digest is known; a flagged contact without a digest keeps counting as opted out
-- through its flag (the lease reads both).

CREATE TABLE destination_consent (
    tenant_id           uuid NOT NULL REFERENCES tenants (id) ON DELETE RESTRICT,
    channel             text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    destination_digest  bytea NOT NULL CHECK (octet_length(destination_digest) = 32),
    state               text NOT NULL CHECK (state IN ('opted_in', 'opted_out')),
    source              text NOT NULL CHECK (source IN ('api', 'inbound_keyword',
                            'provider_stop', 'provider_bounce', 'operator', 'import')),
    actor               text NOT NULL CHECK (length(actor) BETWEEN 1 AND 200),
    keyword             text NULL CHECK (length(keyword) <= 64),
    correlation_id      text NULL CHECK (length(correlation_id) <= 200),
    provider_event      text NULL CHECK (length(provider_event) <= 200),
    changed_at          timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, channel, destination_digest)
);

CREATE TABLE consent_history (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id           uuid NOT NULL REFERENCES tenants (id) ON DELETE RESTRICT,
    channel             text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    destination_digest  bytea NOT NULL CHECK (octet_length(destination_digest) = 32),
    state               text NOT NULL CHECK (state IN ('opted_in', 'opted_out')),
    source              text NOT NULL,
    actor               text NOT NULL,
    keyword             text NULL,
    correlation_id      text NULL,
    provider_event      text NULL,
    recorded_at         timestamptz NOT NULL
);

-- A destination's history in order; and the replay guard of inbound messages: one provider
-- event changes a tenant's consent once.
CREATE INDEX consent_history_destination_idx
    ON consent_history (tenant_id, channel, destination_digest, id);
CREATE UNIQUE INDEX consent_history_event_idx
    ON consent_history (tenant_id, provider_event) WHERE provider_event IS NOT NULL;

CREATE FUNCTION public.nudge_consent_history_append() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO public.consent_history (tenant_id, channel, destination_digest, state, source,
                                        actor, keyword, correlation_id, provider_event,
                                        recorded_at)
    VALUES (NEW.tenant_id, NEW.channel, NEW.destination_digest, NEW.state, NEW.source,
            NEW.actor, NEW.keyword, NEW.correlation_id, NEW.provider_event, NEW.changed_at);
    RETURN NULL;
END $$;

CREATE TRIGGER destination_consent_history
    AFTER INSERT OR UPDATE ON destination_consent
    FOR EACH ROW EXECUTE FUNCTION public.nudge_consent_history_append();

CREATE FUNCTION public.nudge_consent_refuse_change() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RAISE EXCEPTION '% on %: consent is never removed, and its history is append-only',
        TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END $$;

CREATE TRIGGER consent_history_append_only
    BEFORE UPDATE OR DELETE ON consent_history
    FOR EACH ROW EXECUTE FUNCTION public.nudge_consent_refuse_change();
CREATE TRIGGER consent_history_no_truncate
    BEFORE TRUNCATE ON consent_history
    FOR EACH STATEMENT EXECUTE FUNCTION public.nudge_consent_refuse_change();
CREATE TRIGGER destination_consent_kept
    BEFORE DELETE ON destination_consent
    FOR EACH ROW EXECUTE FUNCTION public.nudge_consent_refuse_change();
CREATE TRIGGER destination_consent_no_truncate
    BEFORE TRUNCATE ON destination_consent
    FOR EACH STATEMENT EXECUTE FUNCTION public.nudge_consent_refuse_change();

REVOKE ALL ON FUNCTION public.nudge_consent_history_append() FROM PUBLIC;
REVOKE ALL ON FUNCTION public.nudge_consent_refuse_change() FROM PUBLIC;

-- The opt-outs providers reported before: one row per destination, at its first report.
INSERT INTO destination_consent (tenant_id, channel, destination_digest, state, source, actor,
                                 changed_at)
SELECT DISTINCT ON (tenant_id, channel, destination_digest)
       tenant_id, channel, destination_digest, 'opted_out', 'provider_stop', 'migration',
       opted_out_at
FROM contacts
WHERE opted_out_at IS NOT NULL AND destination_digest IS NOT NULL
ORDER BY tenant_id, channel, destination_digest, opted_out_at;

-- The account a worker sends through by default, per channel: the last time a worker of the
-- sender announced it as its default. An inbound STOP to such an account reaches every tenant
-- without an account of its own on the channel. Never cleared: an account that was a default
-- once keeps counting as one (the safe side for an opt-out).
ALTER TABLE worker_accounts ADD COLUMN default_announced_at timestamptz NULL;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_worker') THEN
        GRANT SELECT, INSERT, UPDATE ON public.destination_consent TO nudge_worker;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_intake') THEN
        GRANT SELECT, INSERT, UPDATE ON public.destination_consent TO nudge_intake;
        GRANT SELECT ON public.consent_history TO nudge_intake;
        GRANT SELECT ON public.worker_accounts TO nudge_intake;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_janitor') THEN
        GRANT SELECT ON public.destination_consent TO nudge_janitor;
        GRANT SELECT ON public.consent_history TO nudge_janitor;
    END IF;
END $$;
