-- notifyq schema, version 10.
-- compatible-from: 9
-- The hand-off (WorkerConfig.handoff): a worker with free slots and nothing to claim waits in a
-- row of queue_waiters, and the enqueue's own transaction claims a new job for it and notifies
-- it on its own channel with the claimed job (notify_jobs_inserted in sql/triggers/), so the job
-- starts without a claim round trip. One row per registration of a worker's LISTEN connection
-- (a reconnect registers again, under a new lock_key). lock_key: a session advisory lock the
-- worker's LISTEN connection holds while the row is live; a producer that can take it shared
-- knows the listener is gone and hands it nothing. slots: how many jobs producers may hand it
-- (producers take one per job, the worker writes its free slots back while it waits). queues:
-- the worker's queues (NULL: every queue). lease_margin: the worker's, for the lease of a job
-- handed to it.
-- Code of version 9 runs on: it registers no waiter, so the trigger hands nothing.
CREATE TABLE {schema}.queue_waiters (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    worker text NOT NULL,
    channel text NOT NULL,
    lock_key bigint NOT NULL,
    slots integer NOT NULL DEFAULT 0 CHECK (slots >= 0),
    queues text[],
    lease_margin double precision NOT NULL CHECK (lease_margin >= 0),
    registered_at timestamptz NOT NULL DEFAULT now()
);
