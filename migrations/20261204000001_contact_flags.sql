-- What providers said about a contact on its channel: the destination cannot receive
-- (`invalid_at`: an invalid number, an unregistered device token, a hard bounce) or the
-- recipient opted out (`opted_out_at`: replied STOP, unsubscribed). Set by the worker in the
-- same statement as the outcome that showed it, or by a delivery receipt. A delivery to a
-- contact flagged opted out settles `cancelled` without a send, one to a contact flagged
-- invalid is dead-lettered `contact_invalid` without a send. Storing a new destination for the
-- contact clears both: the flags describe the destination they were learnt from.
ALTER TABLE contacts
    ADD COLUMN invalid_at   timestamptz NULL,
    ADD COLUMN opted_out_at timestamptz NULL;
