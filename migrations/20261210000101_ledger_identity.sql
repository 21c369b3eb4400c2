-- A ledger restored from a backup taken at T believes that everything sent after T is still
-- owed. The database's own identity tells a restore apart (docs/decisions/0301-restored-ledger.md):
--
-- * `system_identifier` (pg_control_system()): set by initdb, kept by physical replicas and
--   by a base backup restored to a point in time; a pg_dump restored into another cluster
--   has another.
-- * the timeline (the first 8 hex digits of the current WAL file's name): a new one begins
--   whenever archive recovery ends, a point-in-time restore and a promoted standby alike.
-- * the database's OID: a database created again (a pg_dump restored into the same cluster)
--   has another; physical replication keeps it.
-- * a heartbeat: the database's clock, stamped every few seconds by a running binary while
--   the identity is the recorded one. A standby promoted after a synchronous primary died
--   carries a heartbeat seconds old; a restored copy carries the backup's.
--
-- `nudge_ledger_observe()` compares what the server reports with the recorded identity,
-- decides (first start, same, failover, restored), records what it decided and stamps the
-- heartbeat unless the ledger is restored. The roles of the binaries that send or publish and
-- of the janitor (which stamps the heartbeat) may call it and touch nothing else here: no role
-- but the owner (`nudgectl restore reconcile`) can clear a restore.

CREATE TABLE ledger_identity (
    -- One row.
    id                  boolean PRIMARY KEY DEFAULT true CHECK (id),
    system_identifier   bigint NOT NULL,
    timeline_id         bigint NOT NULL CHECK (timeline_id >= 1),
    database_oid        oid NOT NULL,
    recorded_at         timestamptz NOT NULL,
    heartbeat_at        timestamptz NOT NULL,
    -- Longer than a failover takes (the primary's death, the promotion, the first check after
    -- it), shorter than any backup's age at its restore.
    failover_max_gap    interval NOT NULL DEFAULT interval '60 seconds'
                        CHECK (failover_max_gap > interval '0' AND failover_max_gap <= interval '1 hour'),
    -- Set while the ledger is restored and not reconciled: what was found, when and why.
    restored_at         timestamptz NULL,
    restored_reason     text NULL,
    found_system_identifier bigint NULL,
    found_timeline_id   bigint NULL,
    found_database_oid  oid NULL,
    CHECK ((restored_at IS NULL) = (restored_reason IS NULL)),
    CHECK ((restored_at IS NULL) = (found_system_identifier IS NULL))
);

-- What each observation decided when it changed something, append-only.
CREATE TABLE ledger_identity_events (
    id                  bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at                  timestamptz NOT NULL,
    event               text NOT NULL CHECK (event IN ('first_start', 'failover', 'restored',
                                                      'reconciled')),
    system_identifier   bigint NOT NULL,
    timeline_id         bigint NOT NULL,
    database_oid        oid NOT NULL,
    previous_system_identifier bigint NULL,
    previous_timeline_id bigint NULL,
    previous_database_oid oid NULL,
    -- The recorded heartbeat's age when the change was seen.
    heartbeat_age_ms    bigint NULL,
    detail              text NOT NULL
);

CREATE FUNCTION ledger_identity_events_append_only() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    RAISE EXCEPTION 'ledger_identity_events is append-only';
END;
$$;
CREATE TRIGGER ledger_identity_events_append_only BEFORE UPDATE OR DELETE ON ledger_identity_events
    FOR EACH ROW EXECUTE FUNCTION ledger_identity_events_append_only();
CREATE TRIGGER ledger_identity_events_no_truncate BEFORE TRUNCATE ON ledger_identity_events
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_identity_events_append_only();

-- Observes the server's identity and decides: 'first_start' (nothing recorded: recorded now),
-- 'same', 'failover' (a new timeline or cluster with a heartbeat younger than
-- failover_max_gap: adopted), 'restored' (anything else; stays so until reconciled), or
-- 'in_recovery' (a standby: nothing is decided). The heartbeat is stamped unless restored.
CREATE FUNCTION public.nudge_ledger_observe()
RETURNS TABLE (verdict text, reason text, heartbeat_at timestamptz, restored_at timestamptz)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v public.ledger_identity%ROWTYPE;
    v_now timestamptz := pg_catalog.now();
    v_sysid bigint;
    v_tli bigint;
    v_db oid;
    v_age interval;
    v_why text;
BEGIN
    IF pg_catalog.pg_is_in_recovery() THEN
        RETURN QUERY SELECT 'in_recovery'::text,
            'the server is a standby in recovery: connect to the primary'::text,
            NULL::timestamptz, NULL::timestamptz;
        RETURN;
    END IF;
    SELECT s.system_identifier INTO v_sysid FROM pg_catalog.pg_control_system() s;
    v_tli := ('x' || pg_catalog.lpad(pg_catalog.substr(
                 pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_lsn()), 1, 8), 16, '0'))
             ::bit(64)::bigint;
    SELECT d.oid INTO v_db FROM pg_catalog.pg_database d
    WHERE d.datname = pg_catalog.current_database();

    SELECT i.* INTO v FROM public.ledger_identity i FOR UPDATE;
    IF NOT FOUND THEN
        INSERT INTO public.ledger_identity (system_identifier, timeline_id, database_oid,
                                            recorded_at, heartbeat_at)
        VALUES (v_sysid, v_tli, v_db, v_now, v_now)
        ON CONFLICT (id) DO NOTHING;
        IF FOUND THEN
            INSERT INTO public.ledger_identity_events (at, event, system_identifier, timeline_id,
                                                       database_oid, detail)
            VALUES (v_now, 'first_start', v_sysid, v_tli, v_db,
                    'no identity was recorded: this one is the ledger''s from now on');
            RETURN QUERY SELECT 'first_start'::text, 'identity recorded'::text, v_now,
                NULL::timestamptz;
            RETURN;
        END IF;
        -- Another session recorded it meanwhile.
        SELECT i.* INTO v FROM public.ledger_identity i FOR UPDATE;
    END IF;

    IF v.restored_at IS NOT NULL THEN
        RETURN QUERY SELECT 'restored'::text, v.restored_reason, v.heartbeat_at, v.restored_at;
        RETURN;
    END IF;

    IF v.system_identifier = v_sysid AND v.timeline_id = v_tli AND v.database_oid = v_db THEN
        UPDATE public.ledger_identity i SET heartbeat_at = GREATEST(i.heartbeat_at, v_now);
        RETURN QUERY SELECT 'same'::text, 'the recorded identity'::text, v_now,
            NULL::timestamptz;
        RETURN;
    END IF;

    v_age := v_now - v.heartbeat_at;
    IF v.system_identifier = v_sysid AND v.database_oid <> v_db THEN
        -- Physical replication keeps a database's OID: a new one is a database created again.
        v_why := pg_catalog.format(
            'the database was created again (OID %s, recorded %s): a dump restored into the '
            'same cluster; the heartbeat is %s old', v_db, v.database_oid,
            pg_catalog.date_trunc('second', v_age));
    ELSIF v_age <= v.failover_max_gap THEN
        UPDATE public.ledger_identity i
        SET system_identifier = v_sysid, timeline_id = v_tli, database_oid = v_db,
            recorded_at = v_now, heartbeat_at = v_now;
        INSERT INTO public.ledger_identity_events (at, event, system_identifier, timeline_id,
            database_oid, previous_system_identifier, previous_timeline_id,
            previous_database_oid, heartbeat_age_ms, detail)
        VALUES (v_now, 'failover', v_sysid, v_tli, v_db, v.system_identifier, v.timeline_id,
                v.database_oid, (EXTRACT(EPOCH FROM v_age) * 1000)::bigint,
                pg_catalog.format(
                    'timeline %s -> %s, system %s -> %s with a heartbeat %s old (at most %s): '
                    'a promoted replica that had every commit', v.timeline_id, v_tli,
                    v.system_identifier, v_sysid, pg_catalog.date_trunc('second', v_age),
                    v.failover_max_gap));
        RETURN QUERY SELECT 'failover'::text, 'a new identity with a fresh heartbeat: adopted'::text,
            v_now, NULL::timestamptz;
        RETURN;
    ELSIF v.system_identifier <> v_sysid THEN
        v_why := pg_catalog.format(
            'another cluster (system %s, recorded %s) with a heartbeat %s old (more than %s): '
            'a dump restored into a new cluster', v_sysid, v.system_identifier,
            pg_catalog.date_trunc('second', v_age), v.failover_max_gap);
    ELSE
        v_why := pg_catalog.format(
            'a new timeline (%s, recorded %s) with a heartbeat %s old (more than %s): a base '
            'backup recovered to a point in time, or a replica promoted long after it stopped '
            'replicating', v_tli, v.timeline_id, pg_catalog.date_trunc('second', v_age),
            v.failover_max_gap);
    END IF;
    UPDATE public.ledger_identity i
    SET restored_at = v_now, restored_reason = v_why, found_system_identifier = v_sysid,
        found_timeline_id = v_tli, found_database_oid = v_db;
    INSERT INTO public.ledger_identity_events (at, event, system_identifier, timeline_id,
        database_oid, previous_system_identifier, previous_timeline_id, previous_database_oid,
        heartbeat_age_ms, detail)
    VALUES (v_now, 'restored', v_sysid, v_tli, v_db, v.system_identifier, v.timeline_id,
            v.database_oid, (EXTRACT(EPOCH FROM v_age) * 1000)::bigint, v_why);
    RETURN QUERY SELECT 'restored'::text, v_why, v.heartbeat_at, v_now;
END;
$$;

REVOKE ALL ON FUNCTION public.nudge_ledger_observe() FROM PUBLIC;

DO $$
DECLARE
    v_role text;
BEGIN
    FOREACH v_role IN ARRAY ARRAY['nudge_worker', 'nudge_producer', 'nudge_janitor'] LOOP
        IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = v_role) THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION public.nudge_ledger_observe() TO %I', v_role);
        END IF;
    END LOOP;
END $$;
