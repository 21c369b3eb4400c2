-- The consent history's deletable entries, indexed on their own (decision 0506).
--
-- Retention's audit step deletes entries older than the audit boundary in id order, but never
-- those a patient's inbound message wrote (`provider_event` set: a STOP or a START, the replay
-- guard of that message; provider opt-outs recorded from a send's answer or a receipt carry no
-- `provider_event` and are deleted like any other entry, as migration 20261219000002's comments
-- did not say). The kept entries sit at the lowest ids: without this index every batch would
-- read past all of them first.

CREATE INDEX consent_history_deletable_idx ON consent_history (id)
    WHERE provider_event IS NULL;
