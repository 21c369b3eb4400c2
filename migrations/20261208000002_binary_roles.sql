-- Each binary connects with its own role, holding only the rights its statements use.
--
-- * `nudge_worker` (nudge-push, nudge-email, nudge-sms): leases, fences and records; reads
--   destinations. No `tenant_secrets`, no `audit_log`, no DELETE, no DDL.
-- * `nudge_producer`: run intents, deliveries, the relay. No contacts, no secrets.
-- * `nudge_intake`: reminders, contacts (and their erasure), cancellations, receipts, the
--   tenants' signing secrets (read only: `nudgectl` rotates them).
-- * `nudge_janitor`: as before, minus what let it switch retention's protections off. It
--   had UPDATE on every table (cancel a redrive and its dead letters become deletable;
--   rewrite `channel_controls.owner` and the ownership rule is gone) and INSERT on
--   `audit_log`. Now it updates only the delivery columns its sweeps write (never a
--   delivery's owner, channel or times), and changes redrives only through the feeder's
--   SECURITY DEFINER functions below, which also write the feeder's two audit rows (with a
--   fixed actor and action): no UPDATE on `redrives` or `redrive_items`, no INSERT on
--   `audit_log`.
-- * `nudgectl` and the migrations keep the owning role.
--
-- A `FOR SHARE` or `FOR UPDATE` row lock needs UPDATE on some column of the table. Where a
-- role only locks (the tenant's row while importing, the channel's control row while
-- materialising), it gets UPDATE on the primary key column alone: any real change of it is
-- refused by the foreign keys (`tenants.id`) or by the CHECK and the primary key
-- (`channel_controls.channel`, one row per channel), so the grant is a lock and nothing else.
--
-- Sequences need no grant: every id is an identity column, whose sequence an INSERT
-- advances without a privilege check. docs/database-roles.md lists every right that results;
-- `crates/ledger/tests/roles.rs` compares it with the catalogs.
--
-- Roles are cluster-wide: each is created once, if missing, and two databases migrating at
-- once may race (the loser finds it made). Where the migrating role may not create roles,
-- an administrator creates them first (`CREATE ROLE nudge_worker LOGIN`, ...; NOLOGIN works
-- too for a role that is only SET to); a role that does not exist is skipped with a notice
-- and its binary keeps using whatever role its `database.url` names.

DO $$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['nudge_worker', 'nudge_producer', 'nudge_intake', 'nudge_janitor'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = v_role) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT',
                               v_role);
            EXCEPTION
                WHEN duplicate_object OR unique_violation THEN NULL;
                WHEN insufficient_privilege THEN
                    RAISE NOTICE 'cannot create role %; create it, then grant as in migration 20261208000002',
                        v_role;
            END;
        END IF;
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = v_role) THEN
            -- Start from nothing: what a role held before (the janitor's grants of migration
            -- 20261202000001, column grants included) is replaced by what follows.
            EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA public FROM %I', v_role);
            EXECUTE format('REVOKE ALL ON ALL SEQUENCES IN SCHEMA public FROM %I', v_role);
            EXECUTE format('REVOKE CREATE ON SCHEMA public FROM %I', v_role);
            EXECUTE format('GRANT USAGE ON SCHEMA public TO %I', v_role);
            EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE ALL ON TABLES FROM %I',
                           v_role);
            EXECUTE format('ALTER DEFAULT PRIVILEGES IN SCHEMA public REVOKE ALL ON SEQUENCES FROM %I',
                           v_role);
        END IF;
    END LOOP;
END $$;

-- The redrive feeder's writes, for a role that may not update redrives. Each changes one
-- redrive the way the feeder does and nothing else; the row stays locked until the caller's
-- transaction ends, as with the feeder's own `FOR UPDATE`.

-- Locks redrive p_redrive for one feeder tick when it is running, or paused for new work
-- waiting (the pause the feeder lifts by itself); false when it is neither, or another
-- janitor holds it.
CREATE FUNCTION public.nudge_redrive_lock_for_tick(p_redrive bigint)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM 1 FROM public.redrives r
    WHERE r.id = p_redrive
      AND (r.state = 'running' OR (r.state = 'paused' AND r.pause_reason LIKE 'new_work_waiting%'))
    FOR UPDATE SKIP LOCKED;
    RETURN FOUND;
END;
$$;

-- A running redrive pauses; audited as the janitor's `redrive_auto_pause`.
CREATE FUNCTION public.nudge_redrive_auto_pause(p_redrive bigint, p_reason text, p_at timestamptz)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v public.redrives%ROWTYPE;
BEGIN
    IF p_reason IS NULL OR length(p_reason) NOT BETWEEN 1 AND 500 THEN
        RAISE EXCEPTION 'a pause needs a reason of 1 to 500 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE public.redrives r SET state = 'paused', pause_reason = p_reason, updated_at = p_at
    WHERE r.id = p_redrive AND r.state = 'running'
    RETURNING r.* INTO v;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'redrive % is not running', p_redrive
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO public.audit_log (at, actor, action, target, reason, incident, details)
    VALUES (p_at, 'nudge-janitor', 'redrive_auto_pause', 'redrive:' || p_redrive, p_reason,
            v.incident, pg_catalog.jsonb_build_object('fed', v.fed, 'selected', v.selected));
END;
$$;

-- A redrive paused for new work waiting runs again from p_at; audited as the janitor's
-- `redrive_auto_resume`.
CREATE FUNCTION public.nudge_redrive_auto_resume(p_redrive bigint, p_reason text, p_at timestamptz)
RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v public.redrives%ROWTYPE;
BEGIN
    SELECT r.* INTO v FROM public.redrives r
    WHERE r.id = p_redrive AND r.state = 'paused' AND r.pause_reason LIKE 'new_work_waiting%'
    FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'redrive % is not paused for new work waiting', p_redrive
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE public.redrives r SET state = 'running', pause_reason = NULL, running_since = p_at,
        fed_until = p_at, updated_at = p_at
    WHERE r.id = p_redrive;
    INSERT INTO public.audit_log (at, actor, action, target, reason, incident, details)
    VALUES (p_at, 'nudge-janitor', 'redrive_auto_resume', 'redrive:' || p_redrive, p_reason,
            v.incident, pg_catalog.jsonb_build_object('paused_for', v.pause_reason));
END;
$$;

-- A running redrive of a draining channel is held: no credit for the time.
CREATE FUNCTION public.nudge_redrive_hold(p_redrive bigint, p_at timestamptz)
RETURNS void LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE public.redrives SET fed_until = p_at WHERE id = p_redrive AND state = 'running';
$$;

-- A running redrive's canary passed.
CREATE FUNCTION public.nudge_redrive_canary_passed(p_redrive bigint, p_at timestamptz)
RETURNS void LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE public.redrives SET canary_passed_at = p_at
    WHERE id = p_redrive AND state = 'running' AND canary IS NOT NULL AND canary_passed_at IS NULL;
$$;

-- Feeds the next p_take (0 to 10000) items of running redrive p_redrive at p_now: each still
-- dead-lettered, still owned by sender p_sender, not expired and of a tenant not paused goes
-- back `retry_wait` in the `redrive` lane, spaced 1 / rate apart from p_from; the rest are
-- marked skipped with why. Then adds what it fed and skipped to the redrive, moves fed_until
-- by exactly what was fed, and finishes the redrive once every selected item was fed or
-- skipped. p_sender must be the channel's owner or its previous owner (the janitor's own
-- sender while an ownership change is under way).
CREATE FUNCTION public.nudge_redrive_feed(p_redrive bigint, p_take bigint, p_now timestamptz,
                                          p_from timestamptz, p_sender text)
RETURNS TABLE (fed bigint, skipped bigint, finished boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v public.redrives%ROWTYPE;
    v_fed bigint := 0;
    v_skipped bigint := 0;
    v_finished boolean;
BEGIN
    IF p_take IS NULL OR p_take < 0 OR p_take > 10000 THEN
        RAISE EXCEPTION 'a feed takes 0 to 10000 items' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT r.* INTO v FROM public.redrives r WHERE r.id = p_redrive AND r.state = 'running'
    FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'redrive % is not running', p_redrive
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM public.channel_controls c
                   WHERE c.channel = v.channel
                     AND p_sender IN (c.owner, COALESCE(c.previous_owner, c.owner))) THEN
        RAISE EXCEPTION 'sender % neither owns channel % nor owned it before', p_sender, v.channel
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_take > 0 THEN
        WITH next AS (
            SELECT ri.position, ri.delivery_id, d.state, d.expires_at, d.owner, t.intake_paused
            FROM public.redrive_items ri
            JOIN public.deliveries d ON d.id = ri.delivery_id
            JOIN public.tenants t ON t.id = d.tenant_id
            WHERE ri.redrive_id = p_redrive AND ri.fed_at IS NULL AND ri.skipped_reason IS NULL
            ORDER BY ri.position LIMIT p_take
            FOR UPDATE OF ri, d),
        judged AS (
            SELECT n.position, n.delivery_id,
                CASE WHEN n.state <> 'dead_lettered' OR n.owner <> p_sender THEN 'moved_on'
                     WHEN n.expires_at <= p_now THEN 'expired_before_turn'
                     WHEN n.intake_paused THEN 'tenant_paused' END AS skip
            FROM next n),
        slotted AS (
            SELECT j.*, row_number() OVER (PARTITION BY j.skip IS NULL ORDER BY j.position) AS slot
            FROM judged j),
        fed_rows AS (
            UPDATE public.deliveries d
            SET state = 'retry_wait', lane = 'redrive', settled_at = NULL,
                next_attempt_at = LEAST(p_now, p_from
                    + (s.slot::float8 / v.rate_per_second::float8) * interval '1 second'),
                attempt_base = d.attempt_count, updated_at = p_now
            FROM slotted s
            WHERE d.id = s.delivery_id AND s.skip IS NULL AND d.state = 'dead_lettered'
            RETURNING d.id),
        marked AS (
            UPDATE public.redrive_items ri
            SET fed_at = CASE WHEN s.skip IS NULL THEN p_now END, skipped_reason = s.skip
            FROM slotted s
            WHERE ri.redrive_id = p_redrive AND ri.position = s.position
            RETURNING ri.skipped_reason)
        SELECT count(*) FILTER (WHERE m.skipped_reason IS NULL),
               count(*) FILTER (WHERE m.skipped_reason IS NOT NULL)
        INTO v_fed, v_skipped
        FROM marked m;
    END IF;
    v_finished := v.fed::bigint + v.skipped + v_fed + v_skipped >= v.selected;
    UPDATE public.redrives r
    SET fed = r.fed + v_fed::integer, skipped = r.skipped + v_skipped::integer,
        fed_until = p_from + pg_catalog.round(v_fed::float8 / v.rate_per_second * 1e6)::bigint
                             * interval '1 microsecond',
        updated_at = p_now,
        state = CASE WHEN v_finished THEN 'finished' ELSE r.state END,
        finished_at = CASE WHEN v_finished THEN p_now END
    WHERE r.id = p_redrive;
    RETURN QUERY SELECT v_fed, v_skipped, v_finished;
END;
$$;

REVOKE ALL ON FUNCTION public.nudge_redrive_lock_for_tick(bigint) FROM PUBLIC;
REVOKE ALL ON FUNCTION public.nudge_redrive_auto_pause(bigint, text, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION public.nudge_redrive_auto_resume(bigint, text, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION public.nudge_redrive_hold(bigint, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION public.nudge_redrive_canary_passed(bigint, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION public.nudge_redrive_feed(bigint, bigint, timestamptz, timestamptz, text)
    FROM PUBLIC;

-- The workers.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_worker') THEN
        GRANT SELECT ON public.deliveries, public.reminders, public.contacts, public.rate_buckets,
            public.tenant_channels, public.channel_controls, public.redrives,
            public.redrive_items, public.attempts
            TO nudge_worker;
        GRANT UPDATE ON public.deliveries, public.rate_buckets TO nudge_worker;
        GRANT INSERT ON public.attempts, public.rate_buckets TO nudge_worker;
        -- A provider's answer flags the contact (invalid, opted out).
        GRANT UPDATE (invalid_at, opted_out_at) ON public.contacts TO nudge_worker;
    END IF;
END $$;

-- The producer.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_producer') THEN
        GRANT SELECT ON public.tenants, public.schedules, public.reminders, public.run_intents,
            public.deliveries, public.channel_controls, public.rate_buckets,
            public.producer_acks
            TO nudge_producer;
        GRANT INSERT ON public.run_intents, public.deliveries, public.producer_acks
            TO nudge_producer;
        GRANT UPDATE ON public.deliveries, public.producer_acks TO nudge_producer;
        GRANT UPDATE (deliveries_created) ON public.run_intents TO nudge_producer;
        GRANT UPDATE (id) ON public.tenants TO nudge_producer;
        GRANT UPDATE (channel) ON public.channel_controls TO nudge_producer;
    END IF;
END $$;

-- The intake.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_intake') THEN
        GRANT SELECT ON public.tenants, public.tenant_secrets, public.tenant_channels,
            public.channel_controls, public.reminders, public.deliveries, public.contacts,
            public.run_intents, public.provider_events
            TO nudge_intake;
        GRANT INSERT ON public.reminders, public.deliveries, public.contacts,
            public.provider_events, public.audit_log
            TO nudge_intake;
        GRANT UPDATE ON public.reminders, public.deliveries, public.contacts TO nudge_intake;
        GRANT DELETE ON public.contacts TO nudge_intake;
        GRANT UPDATE (id) ON public.tenants TO nudge_intake;
        GRANT UPDATE (channel) ON public.channel_controls TO nudge_intake;
    END IF;
END $$;

-- The janitor.
DO $$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'nudge_janitor') THEN
        -- Reads: the sweeps, the retention plan and blockers, the gauges, the schema check.
        GRANT SELECT ON public.tenants, public.tenant_channels, public.schedules,
            public.reminders, public.contacts, public.deliveries, public.attempts,
            public.run_intents, public.rate_buckets, public.audit_log, public.dead_letters,
            public.redrives, public.redrive_items, public.channel_controls,
            public.producer_acks, public.retention_runs, public.provider_events,
            public._sqlx_migrations
            TO nudge_janitor;
        -- The orphan watchdog materialises, the reaper records attempts, the dead-letter
        -- recorder records, retention records its runs.
        GRANT INSERT ON public.deliveries, public.attempts, public.dead_letters,
            public.retention_runs
            TO nudge_janitor;
        -- What the expiry sweep, the lease reaper and the dead-letter recorder write.
        GRANT UPDATE (state, settled_at, updated_at, next_attempt_at, lane, attempt_count,
                      lease_owner, lease_expires_at, lease_idempotent, send_started_at,
                      provider_message_id, last_error_class, last_error_reason)
            ON public.deliveries TO nudge_janitor;
        -- The reaper's outcomes flag contacts as a worker's do.
        GRANT UPDATE (invalid_at, opted_out_at) ON public.contacts TO nudge_janitor;
        -- A run's policy and instant are written once; its counts are the functions'.
        GRANT UPDATE (state, stop_reason, finished_at) ON public.retention_runs TO nudge_janitor;
        -- The watchdog's materialisation locks the channel's control row.
        GRANT UPDATE (channel) ON public.channel_controls TO nudge_janitor;
        GRANT EXECUTE ON FUNCTION public.nudge_retention_delete_deliveries(bigint, integer)
            TO nudge_janitor;
        GRANT EXECUTE ON FUNCTION public.nudge_retention_delete_rest(bigint, integer)
            TO nudge_janitor;
        GRANT EXECUTE ON FUNCTION public.nudge_redrive_lock_for_tick(bigint) TO nudge_janitor;
        GRANT EXECUTE ON FUNCTION public.nudge_redrive_auto_pause(bigint, text, timestamptz)
            TO nudge_janitor;
        GRANT EXECUTE ON FUNCTION public.nudge_redrive_auto_resume(bigint, text, timestamptz)
            TO nudge_janitor;
        GRANT EXECUTE ON FUNCTION public.nudge_redrive_hold(bigint, timestamptz) TO nudge_janitor;
        GRANT EXECUTE ON FUNCTION public.nudge_redrive_canary_passed(bigint, timestamptz)
            TO nudge_janitor;
        GRANT EXECUTE ON FUNCTION
            public.nudge_redrive_feed(bigint, bigint, timestamptz, timestamptz, text)
            TO nudge_janitor;
    END IF;
END $$;
