-- The send fence and bounded provider influence.
--
-- `send_started_at` is stamped by the statement that confirms, with the database's clock, that a
-- lease is still held, the delivery has not expired and its reminder is not cancelled: the last
-- statement before the provider request. Only a delivery whose send started can be "maybe sent";
-- the lease reaper gives a lease without it back unsent (no attempt spent, never `ambiguous`).
ALTER TABLE deliveries ADD COLUMN send_started_at timestamptz NULL;
ALTER TABLE deliveries ADD CONSTRAINT deliveries_send_started_only_while_sending
    CHECK (send_started_at IS NULL OR state = 'sending');

-- Why a bucket is paused (which answer, what it asked for, what was kept), for operators.
ALTER TABLE rate_buckets ADD COLUMN pause_cause text NULL CHECK (length(pause_cause) <= 200);
