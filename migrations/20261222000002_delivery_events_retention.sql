-- Delivery events under retention (issue 28, decision 0604): an event goes once it is older
-- than `retention.events_days` and the tenant's webhook acknowledged it (or the tenant has no
-- webhook: a pulling client reads within days, not months), and in any case once older than
-- `retention.events_unacknowledged_days` (an endpoint down or disabled that long). An event
-- not yet numbered never goes. Counted first like every other table, deleted only by
-- retention's functions.
--
-- A run records both boundaries and freezes what its count read: the last position of an
-- event old enough to go (`events_through`) and each webhook's acknowledged position
-- (`event_acks`). Its deletions read those, not the webhooks as they move during the run, so
-- they delete exactly what it counted. A run recorded by a janitor of the previous build
-- (which counted no events: `planned` has no `delivery_events`) deletes none; its policy type
-- is unchanged, so that janitor keeps counting and running during an upgrade.

ALTER TABLE retention_runs
    ADD COLUMN events_s bigint NOT NULL DEFAULT 2592000 CHECK (events_s >= 604800),
    ADD COLUMN events_unacknowledged_s bigint NOT NULL DEFAULT 7776000,
    ADD COLUMN events_through bigint NULL,
    ADD COLUMN event_acks jsonb NULL,
    ADD CONSTRAINT retention_runs_events_unacknowledged_check
        CHECK (events_unacknowledged_s >= events_s),
    ADD CONSTRAINT retention_runs_audit_longest_events_check
        CHECK (audit_s >= events_unacknowledged_s);

-- Why an event stays at `p_at`, or NULL: `too_young`, or `unacknowledged` while not yet
-- numbered, or while the tenant's webhook (`acked_position`, NULL for a tenant without one)
-- has not acknowledged it and it is younger than the unacknowledged boundary.
CREATE FUNCTION public.nudge_retention_event_keep(e public.delivery_events, p_at timestamptz,
                                                  p_events_s bigint,
                                                  p_unacknowledged_s bigint,
                                                  acked_position bigint)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN e.occurred_at > p_at - make_interval(secs => p_events_s) THEN 'too_young'
        WHEN e.position IS NULL THEN 'unacknowledged'
        WHEN acked_position IS NOT NULL AND e.position > acked_position
             AND e.occurred_at > p_at - make_interval(secs => p_unacknowledged_s)
             THEN 'unacknowledged'
    END
$$;

-- Retention's last steps, with the delivery events' before the audit log's.
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

    -- Delivery events, by what the run froze when it counted them (`events_through`,
    -- `event_acks`): acknowledged then (or of a tenant without a webhook then) past the
    -- events' boundary, the others past the unacknowledged one. In position order, through
    -- the position index, never past the last old event the count saw.
    DELETE FROM public.delivery_events e WHERE e.id IN (
        SELECT x.id FROM public.retention_runs rr
        JOIN public.delivery_events x ON x.position <= rr.events_through
        WHERE rr.id = p_run AND rr.planned ? 'delivery_events'
          AND x.occurred_at <= p.at - make_interval(secs => rr.events_s)
          AND public.nudge_retention_event_keep(x, p.at, rr.events_s,
                  rr.events_unacknowledged_s, (rr.event_acks ->> x.tenant_id::text)::bigint)
              IS NULL
        ORDER BY x.position LIMIT p_limit FOR UPDATE OF x SKIP LOCKED);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    IF v_n > 0 THEN
        PERFORM public.nudge_retention_count(p_run, 'delivery_events', v_n);
        RETURN QUERY SELECT 'delivery_events'::text, v_n;
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

