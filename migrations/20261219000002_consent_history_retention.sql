-- The consent history under retention (decision 0506): it is an audit record, kept on the
-- audit log's boundary (`retention.audit_days`, default 2190 days: six years; never under its
-- floor of 365 days, nor under any delivery boundary, which the policy's CHECK holds). Entries
-- older than the boundary are deleted by retention's audit step, counted first like every
-- other table; a destination's current consent (`destination_consent`) is never deleted, nor
-- is an entry a provider's message wrote (`provider_event`: a patient's STOP or START, a
-- provider's opt-out): it is the replay guard of that message, and Twilio's signatures carry no
-- time, so a captured START must stay refused for good.
--
-- The history's guard becomes the audit log's: UPDATE is always refused; DELETE only inside
-- retention's audit step (`nudge.retention = audit`), of entries older than the instant the
-- step names and never of one younger than 365 days, whatever the session set. TRUNCATE stays
-- refused.

CREATE FUNCTION public.nudge_consent_history_retention_only() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_OP = 'DELETE'
       AND current_setting('nudge.retention', true) = 'audit'
       AND OLD.recorded_at <= NULLIF(current_setting('nudge.audit_before', true), '')::timestamptz
       AND OLD.recorded_at <= now() - interval '365 days'
       AND OLD.provider_event IS NULL THEN
        RETURN OLD;
    END IF;
    RAISE EXCEPTION '% on %: consent is never removed, and its history is append-only (retention deletes only entries older than the audit boundary)',
        TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'insufficient_privilege';
END $$;
REVOKE ALL ON FUNCTION public.nudge_consent_history_retention_only() FROM PUBLIC;

DROP TRIGGER consent_history_append_only ON consent_history;
CREATE TRIGGER consent_history_append_only
    BEFORE UPDATE OR DELETE ON consent_history
    FOR EACH ROW EXECUTE FUNCTION public.nudge_consent_history_retention_only();

-- Retention's last steps, with the consent history's after the audit log's.
CREATE OR REPLACE FUNCTION public.nudge_retention_delete_rest(p_run bigint, p_limit integer)
RETURNS TABLE (table_name text, deleted bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    p public.nudge_retention_policy := public.nudge_retention_run_policy(p_run);
    v_n bigint;
BEGIN
    IF p IS NULL THEN
        RAISE EXCEPTION 'retention run % is not running', p_run
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 10000 THEN
        RAISE EXCEPTION 'a retention batch is 1 to 10000 rows' USING ERRCODE = 'invalid_parameter_value';
    END IF;

    DELETE FROM public.reminders r WHERE r.id IN (
        SELECT x.id FROM public.reminders x
        WHERE x.expires_at <= p.at - make_interval(secs => p.reminders_s)
          AND NOT EXISTS (SELECT 1 FROM public.deliveries d WHERE d.reminder_id = x.id)
          AND public.nudge_retention_reminder_keep(x, p, false) IS NULL
        ORDER BY x.expires_at, x.id LIMIT p_limit FOR UPDATE SKIP LOCKED)
      AND NOT EXISTS (SELECT 1 FROM public.deliveries d WHERE d.reminder_id = r.id)
      AND public.nudge_retention_reminder_keep(r, p, false) IS NULL;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n > 0 THEN
        PERFORM public.nudge_retention_count(p_run, 'reminders', v_n);
        RETURN QUERY SELECT 'reminders'::text, v_n;
        RETURN;
    END IF;

    DELETE FROM public.contacts c WHERE (c.tenant_id, c.subscriber_ref, c.channel) IN (
        SELECT x.tenant_id, x.subscriber_ref, x.channel FROM public.contacts x
        WHERE x.updated_at <= p.at - make_interval(secs => p.contacts_s)
          AND public.nudge_retention_contact_keep(x, p, EXISTS (
                  SELECT 1 FROM public.reminders r WHERE r.tenant_id = x.tenant_id
                    AND r.subscriber_ref = x.subscriber_ref AND x.channel = ANY (r.channels)))
              IS NULL
        LIMIT p_limit FOR UPDATE SKIP LOCKED)
      AND public.nudge_retention_contact_keep(c, p, EXISTS (
              SELECT 1 FROM public.reminders r WHERE r.tenant_id = c.tenant_id
                AND r.subscriber_ref = c.subscriber_ref AND c.channel = ANY (r.channels)))
          IS NULL;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n > 0 THEN
        PERFORM public.nudge_retention_count(p_run, 'contacts', v_n);
        RETURN QUERY SELECT 'contacts'::text, v_n;
        RETURN;
    END IF;

    DELETE FROM public.dead_letters l WHERE l.id IN (
        SELECT x.id FROM public.dead_letters x
        WHERE x.recorded_at <= p.at - make_interval(secs => p.dead_lettered_s)
          AND public.nudge_retention_dead_letter_keep(x, p) IS NULL
        ORDER BY x.recorded_at, x.id LIMIT p_limit FOR UPDATE SKIP LOCKED)
      AND public.nudge_retention_dead_letter_keep(l, p) IS NULL;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n > 0 THEN
        PERFORM public.nudge_retention_count(p_run, 'dead_letters', v_n);
        RETURN QUERY SELECT 'dead_letters'::text, v_n;
        RETURN;
    END IF;

    PERFORM set_config('nudge.retention', 'audit', true);
    PERFORM set_config('nudge.audit_before',
                       (p.at - make_interval(secs => p.audit_s))::text, true);
    DELETE FROM public.audit_log a WHERE a.id IN (
        SELECT x.id FROM public.audit_log x WHERE x.at <= p.at - make_interval(secs => p.audit_s)
        ORDER BY x.id LIMIT p_limit FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n > 0 THEN
        PERFORM set_config('nudge.retention', '', true);
        PERFORM set_config('nudge.audit_before', '', true);
        PERFORM public.nudge_retention_count(p_run, 'audit_log', v_n);
        RETURN QUERY SELECT 'audit_log'::text, v_n;
        RETURN;
    END IF;

    -- The consent history, on the audit log's boundary: a destination's current consent
    -- (`destination_consent`) is never deleted, nor an entry a provider's message wrote (the
    -- message's replay guard); only the others older than the boundary go.
    DELETE FROM public.consent_history h WHERE h.id IN (
        SELECT x.id FROM public.consent_history x
        WHERE x.recorded_at <= p.at - make_interval(secs => p.audit_s)
          AND x.provider_event IS NULL
        ORDER BY x.id LIMIT p_limit FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    PERFORM set_config('nudge.retention', '', true);
    PERFORM set_config('nudge.audit_before', '', true);
    IF v_n > 0 THEN
        PERFORM public.nudge_retention_count(p_run, 'consent_history', v_n);
        RETURN QUERY SELECT 'consent_history'::text, v_n;
        RETURN;
    END IF;

    DELETE FROM public.redrives r WHERE r.id IN (
        SELECT x.id FROM public.redrives x
        WHERE x.state IN ('finished', 'cancelled')
          AND x.finished_at <= p.at - make_interval(secs => p.audit_s)
          AND NOT EXISTS (SELECT 1 FROM public.redrive_items ri WHERE ri.redrive_id = x.id)
        ORDER BY x.id LIMIT p_limit FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n > 0 THEN
        PERFORM public.nudge_retention_count(p_run, 'redrives', v_n);
        RETURN QUERY SELECT 'redrives'::text, v_n;
    END IF;
END;
$$;
