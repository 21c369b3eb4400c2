-- SECURITY DEFINER functions resolve nothing through `public`, and PUBLIC may not create there.
--
-- The retention functions ran as their owner with `search_path = pg_catalog, public, pg_temp`:
-- on PostgreSQL 14 or older, where every role may CREATE in `public` by default, a role could
-- create a function or operator there that a definer function then resolved and ran with the
-- owner's rights. Every definer function is recreated here with
-- `search_path = pg_catalog, pg_temp` and every name it uses qualified (`public.deliveries`),
-- and so are the invoker functions they call (a function without its own SET runs with the
-- caller's path, here the definer's, which no longer holds `public`; they keep no SET of
-- their own, so the planner still inlines them). Functions are never looked up in pg_temp;
-- a table or type would be, which is why every table and type below is qualified too.
-- CREATE OR REPLACE keeps each function's owner and grants.
--
-- `REVOKE CREATE ON SCHEMA public FROM PUBLIC` is what PostgreSQL 15 does for a new database;
-- a database created by an older server keeps the old grant until this runs. Run by a role
-- that does not own the schema, it changes nothing (PostgreSQL warns): the schema's owner
-- must then run it (docs/database-roles.md).

CREATE OR REPLACE FUNCTION public.nudge_retention_delivery_keep(d public.deliveries, p public.nudge_retention_policy)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN d.state IN ('scheduled', 'queued', 'sending', 'retry_wait') THEN 'owed'
        WHEN d.state NOT IN ('delivered', 'dead_lettered', 'expired', 'cancelled') THEN 'held'
        WHEN d.state = 'dead_lettered' AND EXISTS (
                 SELECT 1 FROM public.redrive_items ri JOIN public.redrives r ON r.id = ri.redrive_id
                 WHERE ri.delivery_id = d.id AND r.state IN ('running', 'paused'))
             THEN 'awaiting_redrive'
        WHEN d.owner <> (SELECT c.owner FROM public.channel_controls c WHERE c.channel = d.channel)
             THEN 'ownership_uncertain'
        WHEN d.settled_at > p.at - make_interval(secs => CASE d.state
                 WHEN 'delivered' THEN p.delivered_s
                 WHEN 'expired' THEN p.expired_s
                 WHEN 'cancelled' THEN p.cancelled_s
                 ELSE p.dead_lettered_s END)
             THEN 'too_young'
    END
$$;

CREATE OR REPLACE FUNCTION public.nudge_retention_reminder_keep(r public.reminders, p public.nudge_retention_policy,
                                              has_delivery boolean)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN has_delivery THEN 'has_delivery'
        WHEN EXISTS (SELECT 1 FROM public.tenants t WHERE t.id = r.tenant_id AND t.intake_paused)
             OR EXISTS (SELECT 1 FROM public.channel_controls c
                        WHERE c.draining AND c.channel = ANY (r.channels))
             THEN 'held_by_operator'
        WHEN r.expires_at > p.at - make_interval(secs => p.reminders_s) THEN 'too_young'
    END
$$;

CREATE OR REPLACE FUNCTION public.nudge_retention_contact_keep(c public.contacts, p public.nudge_retention_policy,
                                             in_use boolean)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN in_use THEN 'in_use'
        WHEN c.updated_at > p.at - make_interval(secs => p.contacts_s) THEN 'too_young'
    END
$$;

CREATE OR REPLACE FUNCTION public.nudge_retention_dead_letter_keep(l public.dead_letters, p public.nudge_retention_policy)
RETURNS text LANGUAGE sql STABLE AS $$
    SELECT CASE
        WHEN l.delivery_id IS NOT NULL
             AND EXISTS (SELECT 1 FROM public.deliveries d WHERE d.id = l.delivery_id)
             THEN 'with_delivery'
        WHEN l.recorded_at > p.at - make_interval(secs => p.dead_lettered_s) THEN 'too_young'
    END
$$;

CREATE OR REPLACE FUNCTION public.nudge_retention_run_policy(p_run bigint)
RETURNS public.nudge_retention_policy LANGUAGE sql STABLE AS $$
    SELECT ROW(LEAST(r.started_at, now()), r.delivered_s, r.expired_s, r.cancelled_s,
               r.dead_lettered_s, r.reminders_s, r.contacts_s, r.audit_s)::public.nudge_retention_policy
    FROM public.retention_runs r WHERE r.id = p_run AND r.state = 'running'
$$;

CREATE OR REPLACE FUNCTION public.nudge_retention_count(p_run bigint, p_table text, p_n bigint)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_deleted bigint;
    v_planned bigint;
BEGIN
    IF p_n = 0 THEN
        RETURN;
    END IF;
    UPDATE public.retention_runs
    SET deleted = deleted || jsonb_build_object(p_table, COALESCE((deleted ->> p_table)::bigint, 0) + p_n)
    WHERE id = p_run
    RETURNING (deleted ->> p_table)::bigint, COALESCE((planned ->> p_table)::bigint, 0)
    INTO v_deleted, v_planned;
    IF v_deleted > v_planned THEN
        RAISE EXCEPTION 'retention run %: % would delete % rows of %, more than the % it counted',
            p_run, p_table, v_deleted, p_table, v_planned
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION public.nudge_retention_delete_deliveries(p_run bigint, p_limit integer)
RETURNS TABLE (delivery_id uuid, reminder_id uuid, tenant_id uuid, channel text, state text,
               scheduled_at timestamptz, created_at timestamptz, settled_at timestamptz,
               attempt_count integer, outcome_classes text[])
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
-- When nearly every old row may go (the usual case), the planner prefers reading them all
-- and sorting, evaluating the rule on each: 640 ms a batch over 70,000 rows, against 6 ms
-- reading the index in order and stopping at the batch's size.
SET enable_bitmapscan = off SET enable_sort = off AS $$
DECLARE
    p public.nudge_retention_policy := public.nudge_retention_run_policy(p_run);
    v_state text;
    v_ids uuid[] := '{}';
    v_reminders uuid[];
    v_n bigint;
BEGIN
    IF p IS NULL THEN
        RAISE EXCEPTION 'retention run % is not running', p_run
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_limit IS NULL OR p_limit < 1 OR p_limit > 10000 THEN
        RAISE EXCEPTION 'a retention batch is 1 to 10000 rows' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Per state, the index on (state, settled_at) yields the oldest first, so a batch reads
    -- about as many rows as it deletes. The rule is re-checked on each row once its lock is
    -- taken; a row someone else holds is left for a later batch.
    FOREACH v_state IN ARRAY ARRAY['delivered', 'expired', 'cancelled', 'dead_lettered'] LOOP
        EXIT WHEN cardinality(v_ids) >= p_limit;
        v_ids := v_ids || ARRAY(
            SELECT d.id FROM public.deliveries d
            WHERE d.state = v_state
              AND d.settled_at <= p.at - make_interval(secs => CASE v_state
                      WHEN 'delivered' THEN p.delivered_s WHEN 'expired' THEN p.expired_s
                      WHEN 'cancelled' THEN p.cancelled_s ELSE p.dead_lettered_s END)
              AND public.nudge_retention_delivery_keep(d, p) IS NULL
            ORDER BY d.settled_at
            LIMIT p_limit - cardinality(v_ids)
            FOR UPDATE OF d SKIP LOCKED);
    END LOOP;
    IF cardinality(v_ids) = 0 THEN
        RETURN;
    END IF;

    RETURN QUERY
    SELECT d.id, d.reminder_id, d.tenant_id, d.channel, d.state, d.scheduled_at, d.created_at,
           d.settled_at, d.attempt_count,
           COALESCE((SELECT array_agg(a.outcome_class ORDER BY a.attempt_number)
                     FROM public.attempts a WHERE a.delivery_id = d.id), '{}')
    FROM public.deliveries d WHERE d.id = ANY (v_ids);

    PERFORM set_config('nudge.retention', 'on', true);
    DELETE FROM public.redrive_items ri USING public.redrives r
    WHERE ri.delivery_id = ANY (v_ids) AND r.id = ri.redrive_id
      AND r.state IN ('finished', 'cancelled');
    GET DIAGNOSTICS v_n = ROW_COUNT;
    PERFORM public.nudge_retention_count(p_run, 'redrive_items', v_n);

    DELETE FROM public.dead_letters l WHERE l.delivery_id = ANY (v_ids);
    GET DIAGNOSTICS v_n = ROW_COUNT;
    PERFORM public.nudge_retention_count(p_run, 'dead_letters', v_n);

    SELECT count(*) INTO v_n FROM public.attempts a WHERE a.delivery_id = ANY (v_ids);
    PERFORM public.nudge_retention_count(p_run, 'attempts', v_n);

    WITH gone AS (DELETE FROM public.deliveries d WHERE d.id = ANY (v_ids) RETURNING d.reminder_id)
    SELECT array_agg(DISTINCT g.reminder_id) INTO v_reminders FROM gone g;
    PERFORM public.nudge_retention_count(p_run, 'deliveries', cardinality(v_ids));
    PERFORM set_config('nudge.retention', '', true);

    -- Reminders whose last delivery just went, when the policy lets them go too (one with a
    -- delivery left, due to go in a later batch, goes with that one).
    DELETE FROM public.reminders r WHERE r.id = ANY (v_reminders)
      AND NOT EXISTS (SELECT 1 FROM public.deliveries d WHERE d.reminder_id = r.id)
      AND public.nudge_retention_reminder_keep(r, p, false) IS NULL;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    PERFORM public.nudge_retention_count(p_run, 'reminders', v_n);
END;
$$;

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
    PERFORM set_config('nudge.retention', '', true);
    PERFORM set_config('nudge.audit_before', '', true);
    IF v_n > 0 THEN
        PERFORM public.nudge_retention_count(p_run, 'audit_log', v_n);
        RETURN QUERY SELECT 'audit_log'::text, v_n;
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

REVOKE CREATE ON SCHEMA public FROM PUBLIC;
