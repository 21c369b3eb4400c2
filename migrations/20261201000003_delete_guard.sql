-- Only settled history can be deleted, and the database enforces it, not only the janitor.
--
-- A delivery that is scheduled, queued, sending, waiting to retry or held as ambiguous is work
-- nudge still answers for: no DELETE removes it, whoever runs it and whatever session setting
-- (retention's `nudge.retention` opens attempts, never owed work). TRUNCATE, which would skip
-- the row check, is refused outright, including through `TRUNCATE ... CASCADE` from another
-- table.

CREATE FUNCTION nudge_refuse_unsettled_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' AND OLD.state IN ('delivered', 'dead_lettered', 'expired', 'cancelled') THEN
        RETURN OLD;
    END IF;
    IF TG_OP = 'TRUNCATE' THEN
        RAISE EXCEPTION '% may lose owed work: TRUNCATE refused', TG_TABLE_NAME
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RAISE EXCEPTION '% % is %: only delivered, dead_lettered, expired or cancelled rows may be deleted',
        TG_TABLE_NAME, OLD.id, OLD.state
        USING ERRCODE = 'integrity_constraint_violation';
END;
$$;

CREATE TRIGGER deliveries_delete_settled_only BEFORE DELETE ON deliveries
    FOR EACH ROW EXECUTE FUNCTION nudge_refuse_unsettled_delete();
CREATE TRIGGER deliveries_no_truncate BEFORE TRUNCATE ON deliveries
    FOR EACH STATEMENT EXECUTE FUNCTION nudge_refuse_unsettled_delete();

-- No cascade from a tenant or a reminder into work. Deleting a reminder that still has any
-- delivery, or a tenant that still has any reminder, is refused: even a settled delivery is
-- history with its own retention boundary per state, which a cascade from its reminder would
-- ignore, and a reminder not yet materialised is owed work with no delivery to guard it.
-- Retention deletes settled deliveries first, then reminders left without any.
ALTER TABLE deliveries
    DROP CONSTRAINT deliveries_reminder_id_fkey,
    ADD CONSTRAINT deliveries_reminder_id_fkey
        FOREIGN KEY (reminder_id) REFERENCES reminders (id) ON DELETE RESTRICT,
    DROP CONSTRAINT deliveries_tenant_id_fkey,
    ADD CONSTRAINT deliveries_tenant_id_fkey
        FOREIGN KEY (tenant_id) REFERENCES tenants (id) ON DELETE RESTRICT;
ALTER TABLE reminders
    DROP CONSTRAINT reminders_tenant_id_fkey,
    ADD CONSTRAINT reminders_tenant_id_fkey
        FOREIGN KEY (tenant_id) REFERENCES tenants (id) ON DELETE RESTRICT;
