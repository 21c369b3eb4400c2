-- Operator controls per channel (drain and ownership), the owner of each delivery, and the
-- producers' acknowledgement that they have seen the operator flags.

-- One row per channel, always present.
CREATE TABLE channel_controls (
    channel            text PRIMARY KEY CHECK (channel IN ('push', 'email', 'sms')),
    -- Drain: nothing new is scheduled for the channel (reminders are recorded and held), the
    -- redrive lane is closed, and workers finish the work already owed at the admitted rate.
    draining           boolean NOT NULL DEFAULT false,
    drain_incident     text NULL CHECK (length(drain_incident) BETWEEN 1 AND 100),
    drain_started_at   timestamptz NULL,
    -- Who sends this channel's work: nudge's workers lease only what their configured owner
    -- owns; new deliveries take the channel's owner. previous_owner is where a rollback
    -- hands the work back.
    owner              text NOT NULL DEFAULT 'nudge' CHECK (owner ~ '^[a-z0-9][a-z0-9_-]{0,63}$'),
    previous_owner     text NULL CHECK (previous_owner ~ '^[a-z0-9][a-z0-9_-]{0,63}$'),
    changed_by         text NOT NULL,
    changed_at         timestamptz NOT NULL,
    change_reason      text NULL,
    CHECK (draining = (drain_started_at IS NOT NULL))
);
INSERT INTO channel_controls (channel, changed_by, changed_at)
VALUES ('push', 'migration', now()), ('email', 'migration', now()), ('sms', 'migration', now());

CREATE FUNCTION nudge_refuse_control_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'channel_controls keeps one row per channel: % refused', TG_OP
        USING ERRCODE = 'integrity_constraint_violation';
END;
$$;
CREATE TRIGGER channel_controls_keep_rows BEFORE DELETE ON channel_controls
    FOR EACH ROW EXECUTE FUNCTION nudge_refuse_control_delete();
CREATE TRIGGER channel_controls_no_truncate BEFORE TRUNCATE ON channel_controls
    FOR EACH STATEMENT EXECUTE FUNCTION nudge_refuse_control_delete();

-- Which sender owns a delivery (a constant default: adding it rewrites nothing).
ALTER TABLE deliveries
    ADD COLUMN owner text NOT NULL DEFAULT 'nudge' CHECK (owner ~ '^[a-z0-9][a-z0-9_-]{0,63}$');

-- Each producer instance records when its latest schedule pass started (the database's
-- clock): every operator flag committed before that instant was honoured by that pass, so
-- `nudgectl tenant pause` can wait for it.
CREATE TABLE producer_acks (
    instance         text PRIMARY KEY CHECK (length(instance) BETWEEN 1 AND 200),
    pass_started_at  timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL
);

-- `nudgectl export attempts --incident ID`: an incident's attempts in order.
CREATE INDEX attempts_incident_idx ON attempts (incident, id) WHERE incident IS NOT NULL;
