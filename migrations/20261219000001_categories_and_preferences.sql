-- Categories and a subscriber's preferences (decision 0506).
--
-- `categories`: what a tenant's reminders are about (`appointment`, `billing`), created by an
-- operator (`nudgectl category create`, audited). `general` is every tenant's without a row
-- (a reminder without a category belongs to it) and is never required. A `required` category
-- cannot be switched off through the preferences API; a destination's opt-out (a STOP) still
-- stops it. Categories are never deleted: a reminder names one for its whole life.
--
-- `reminders.category`, `series.category`: the category of a reminder and of a series'
-- occurrences (default `general`, a constant default: no rewrite of either table). Their
-- CHECKs are added NOT VALID and left so: every existing row holds the default, and validating
-- would scan `reminders` while this migration's transaction holds it exclusively; new and
-- updated rows are checked.
--
-- `subscriber_preferences`: per tenant, subscriber (the stored reference), channel and
-- category, whether the subscriber wants it, with its last change. No row: opted in. Each row
-- has a `subject`, a random id that never changes; its history (`consent_history`, appended
-- by a trigger as a destination's is) is kept under the subject, never under the reference.
-- An erasure deletes the subscriber's rows: the history stays, naming no one.
--
-- The lease and the fence read it before every send, as they read `destination_consent`;
-- materialisation creates a delivery due now whose destination or category is opted out as
-- settled `suppressed`.

CREATE TABLE categories (
    tenant_id   uuid NOT NULL REFERENCES tenants (id) ON DELETE RESTRICT,
    name        text NOT NULL CHECK (name ~ '^[a-z0-9][a-z0-9_-]{0,63}$' AND name <> 'general'),
    required    boolean NOT NULL,
    created_at  timestamptz NOT NULL,
    created_by  text NOT NULL CHECK (length(created_by) BETWEEN 1 AND 200),
    PRIMARY KEY (tenant_id, name)
);

ALTER TABLE reminders ADD COLUMN category text NOT NULL DEFAULT 'general';
ALTER TABLE reminders ADD CONSTRAINT reminders_category_form
    CHECK (category ~ '^[a-z0-9][a-z0-9_-]{0,63}$') NOT VALID;
ALTER TABLE series ADD COLUMN category text NOT NULL DEFAULT 'general';
ALTER TABLE series ADD CONSTRAINT series_category_form
    CHECK (category ~ '^[a-z0-9][a-z0-9_-]{0,63}$') NOT VALID;

CREATE TABLE subscriber_preferences (
    tenant_id       uuid NOT NULL REFERENCES tenants (id) ON DELETE RESTRICT,
    subscriber_ref  text NOT NULL CHECK (length(subscriber_ref) BETWEEN 1 AND 128),
    channel         text NOT NULL CHECK (channel IN ('push', 'email', 'sms')),
    category        text NOT NULL CHECK (category ~ '^[a-z0-9][a-z0-9_-]{0,63}$'),
    state           text NOT NULL CHECK (state IN ('opted_in', 'opted_out')),
    source          text NOT NULL CHECK (source IN ('api', 'inbound_keyword',
                        'provider_stop', 'provider_bounce', 'operator', 'import')),
    actor           text NOT NULL CHECK (length(actor) BETWEEN 1 AND 200),
    correlation_id  text NULL CHECK (length(correlation_id) <= 200),
    changed_at      timestamptz NOT NULL,
    subject         uuid NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    PRIMARY KEY (tenant_id, subscriber_ref, channel, category)
);

-- The history of a preference: under its subject and category, without a destination.
ALTER TABLE consent_history ALTER COLUMN destination_digest DROP NOT NULL;
ALTER TABLE consent_history ADD COLUMN subject uuid NULL;
ALTER TABLE consent_history ADD COLUMN category text NULL;
ALTER TABLE consent_history ADD CONSTRAINT consent_history_of_one
    CHECK ((destination_digest IS NULL) <> (subject IS NULL)
           AND (subject IS NULL) = (category IS NULL)) NOT VALID;
ALTER TABLE consent_history VALIDATE CONSTRAINT consent_history_of_one;
CREATE INDEX consent_history_subject_idx ON consent_history (subject, id)
    WHERE subject IS NOT NULL;

CREATE FUNCTION public.nudge_preference_history_append() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO public.consent_history (tenant_id, channel, subject, category, state, source,
                                        actor, correlation_id, recorded_at)
    VALUES (NEW.tenant_id, NEW.channel, NEW.subject, NEW.category, NEW.state, NEW.source,
            NEW.actor, NEW.correlation_id, NEW.changed_at);
    RETURN NULL;
END $$;

CREATE TRIGGER subscriber_preferences_history
    AFTER INSERT OR UPDATE ON subscriber_preferences
    FOR EACH ROW EXECUTE FUNCTION public.nudge_preference_history_append();

-- A row's subject is its history's key: it never changes.
CREATE FUNCTION public.nudge_preference_subject_kept() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.subject <> OLD.subject THEN
        RAISE EXCEPTION 'a preference''s subject never changes'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER subscriber_preferences_subject_kept
    BEFORE UPDATE ON subscriber_preferences
    FOR EACH ROW EXECUTE FUNCTION public.nudge_preference_subject_kept();

REVOKE ALL ON FUNCTION public.nudge_preference_history_append() FROM PUBLIC;
REVOKE ALL ON FUNCTION public.nudge_preference_subject_kept() FROM PUBLIC;

DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_intake') THEN
        GRANT SELECT ON public.categories TO nudge_intake;
        GRANT SELECT, INSERT, UPDATE, DELETE ON public.subscriber_preferences TO nudge_intake;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_worker') THEN
        GRANT SELECT ON public.subscriber_preferences TO nudge_worker;
    END IF;
    -- Materialisation asks whether a delivery's destination or category opted out.
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_producer') THEN
        GRANT SELECT (tenant_id, subscriber_ref, channel, destination_digest, opted_out_at)
            ON public.contacts TO nudge_producer;
        GRANT SELECT ON public.destination_consent, public.subscriber_preferences
            TO nudge_producer;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_janitor') THEN
        GRANT SELECT ON public.categories, public.subscriber_preferences TO nudge_janitor;
    END IF;
END $$;
