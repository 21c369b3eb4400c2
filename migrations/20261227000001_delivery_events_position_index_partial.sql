-- Delivery events' position index holds numbered events only (decision 0608).
--
-- `position` was declared `UNIQUE` (migration 20261220000001), and a unique index holds an
-- entry for every row, NULL included: each event written (in the statement that changes its
-- delivery, the worker's record among them) added a NULL entry to it, and the sequencer's
-- numbering, an update that is never HOT since it changes an indexed column, added the numbered
-- entry and left the NULL one dead for vacuum. Every reader of `position` asks for numbered
-- events only (`position > n`, `position <= n`, `max(position)`, `ORDER BY position` after
-- such a condition), so a partial index serves them all.
--
-- Positions stay unique: the new index is unique over the numbered events, the only ones that
-- have one.
--
-- Locks: the build holds a SHARE lock on `delivery_events` and the drop an ACCESS EXCLUSIVE
-- one, both until the migration commits. Meanwhile every statement that writes an event waits
-- (and readers of events wait for the drop); a service's statement gives up after its
-- `database.lock_timeout_ms` (2 s by default) and fails as on any lock it cannot get, and
-- `nudgectl migrate` itself runs under `database.statement_timeout_ms` (30 s by default), so on
-- a large `delivery_events` the build can time out and roll back, to be run again with a
-- longer one. Apply it while the pipeline is quiet.

CREATE UNIQUE INDEX delivery_events_position_idx ON delivery_events (position)
    WHERE position IS NOT NULL;

ALTER TABLE delivery_events DROP CONSTRAINT delivery_events_position_key;
