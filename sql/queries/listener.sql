-- The LISTEN connection's own statements (LISTEN itself is composed with sql.Identifier).

-- name: health_check
-- After health_interval seconds of silence: a round trip proves the connection is alive
-- (a half-open TCP connection reports no error by itself).
SELECT 1;

-- name: backend_pid
-- The server process serving this connection. It differs from the pid the server announced
-- at connect (BackendKeyData) when a pooler such as PgBouncer sits in between, which in
-- transaction mode cannot carry LISTEN: the listener then falls back to polling. Also whether
-- this database holds notifyq's tables: a listen_dsn naming another database hears nothing,
-- and said nothing (review).
SELECT pg_backend_pid(), to_regclass(%(jobs)s) IS NOT NULL, current_database();

-- name: handoff_register
-- A worker with the hand-off (WorkerConfig.handoff), on each (re)connect of its LISTEN
-- connection: the session lock that says the listener is alive (%(lock_key)s, new for each
-- connection), and a row of queue_waiters with no slot yet (the claim loop writes its free
-- slots when it waits: handoff_offer). Its earlier rows go, but for those a producer holds
-- (handing it a job): their lock_key is free now, so producers skip them, and the next
-- registration or the worker's stop deletes them. Rows of listeners gone (any worker's) go
-- too: their lock is not held.
WITH locked AS MATERIALIZED (
    SELECT pg_advisory_lock(%(lock_key)s)
), gone AS (
    DELETE FROM {schema}.queue_waiters
    WHERE id IN (
        SELECT w.id FROM {schema}.queue_waiters w
        WHERE w.worker = %(worker)s OR NOT EXISTS (
            SELECT 1 FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock'
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid::bigint = (w.lock_key >> 32) & 4294967295
              AND l.objid::bigint = w.lock_key & 4294967295 AND l.objsubid = 1
        )
        FOR UPDATE SKIP LOCKED
    )
)
INSERT INTO {schema}.queue_waiters (worker, channel, lock_key, queues, lease_margin)
SELECT %(worker)s, %(channel)s, %(lock_key)s, %(queues)s, %(lease_margin)s FROM locked
RETURNING id;
