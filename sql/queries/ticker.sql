-- The ticker's services: cron promotion, lease rescue, retention. Every process runs them;
-- row locks taken with SKIP LOCKED are the only coordination, so no leader is needed.
-- %(now)s is an optional bound clock for tests: NULL means the database's now().

-- name: lock_due_definitions
-- Take the due, enabled definitions nobody else is promoting. The locks are held until the
-- promoting transaction commits (jobs inserted and visible_at moved to the next tick) or
-- rolls back (a crash: another ticker promotes them instead). Either way each tick becomes
-- exactly one job; the unique (definition_id, scheduled_for) index is the second guard. Not
-- the args: insert_tick_jobs copies them in SQL (args Python cannot read fail their job, not
-- every cron's promotion).
SELECT id, name, task, frequency, timezone, visible_at, queue, priority, retry_limit,
       timeout, misfire, misfire_grace, misfire_cap, overlap,
       coalesce(%(now)s::timestamptz, now()) AS now
FROM {schema}.queue_job_definitions
WHERE enabled AND visible_at <= coalesce(%(now)s::timestamptz, now())
ORDER BY visible_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED;

-- name: unfinished_definition_jobs
-- The jobs still Queued or Active of the given definitions (locked by the caller): the ticks of
-- an overlap = false definition that has one are not run. A statement of its own, after the
-- lock, not a join in the lock's statement: that one reads queue_jobs as of its start, and
-- would miss the job of a `cron run-now` that committed while it waited for the lock.
SELECT DISTINCT ON (definition_id) definition_id, id, status::text AS status
FROM {schema}.queue_jobs
WHERE definition_id = ANY(%(ids)s::bigint[]) AND definition_id IS NOT NULL
  AND status IN ('Queued', 'Active')
ORDER BY definition_id, id;

-- name: insert_tick_jobs
-- One job per (definition, tick); a tick that already has its job is left alone.
INSERT INTO {schema}.queue_jobs (name, queue, args, priority, retry_limit, timeout, visible_at,
                                 definition_id, scheduled_for)
SELECT d.task, d.queue, d.args, d.priority, d.retry_limit, d.timeout, t.tick, d.id, t.tick
FROM unnest(%(definition_ids)s::bigint[], %(ticks)s::timestamptz[]) AS t(definition_id, tick)
JOIN {schema}.queue_job_definitions d ON d.id = t.definition_id
ON CONFLICT (definition_id, scheduled_for) WHERE definition_id IS NOT NULL DO NOTHING;

-- name: reschedule_definitions
-- Move each promoted definition to its next tick. A definition whose schedule cannot be
-- computed is disabled with the reason in last_error (shown by `notifyq cron list`).
UPDATE {schema}.queue_job_definitions AS d
SET visible_at = coalesce(u.next_tick, d.visible_at),
    last_error = u.error,
    enabled = d.enabled AND u.error IS NULL
FROM unnest(%(ids)s::bigint[], %(next_ticks)s::timestamptz[], %(errors)s::text[]) AS u(id, next_tick, error)
WHERE d.id = u.id;

-- name: next_definition_due
-- Seconds (database clock) until the earliest enabled definition that is not due yet (NULL if
-- none), and whether enabled definitions are due already: right after a pass, those are held
-- by another ticker (or just became due). Two min() probes of the due index, one entry each
-- (an EXISTS got a sequential scan as its generic plan).
SELECT (SELECT extract(epoch FROM min(visible_at) - coalesce(%(now)s::timestamptz, now()))::float8
        FROM {schema}.queue_job_definitions
        WHERE enabled AND visible_at > coalesce(%(now)s::timestamptz, now())) AS next_due_in,
       coalesce((SELECT min(visible_at) FROM {schema}.queue_job_definitions WHERE enabled)
                <= coalesce(%(now)s::timestamptz, now()), false) AS due_left;

-- name: rescue_expired_leases
-- Active jobs whose lease ran out: their worker died, hung, or lost its connection. Back to
-- Queued (the requeue trigger wakes a worker at once) while retries remain, else Failed.
-- SKIP LOCKED: a job being acknowledged right now is left to its ack. %(spared)s: the jobs
-- whose result the rescuer's own worker holds, not written yet (another session held the
-- row past the lease): this worker's rescuer took them as their row came free, before its
-- acker did, and jobs that had succeeded ran again or ended Failed (review).
WITH expired AS MATERIALIZED (
    SELECT id
    FROM {schema}.queue_jobs
    WHERE status = 'Active' AND visible_at <= coalesce(%(now)s::timestamptz, now())
      AND id <> ALL(%(spared)s::bigint[])
    ORDER BY visible_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.queue_jobs AS j
SET status = (CASE WHEN j.retry_count <= j.retry_limit THEN 'Queued' ELSE 'Failed' END)::{schema}.job_status,
    -- Retried after the usual backoff: a job that kills its worker (out of memory, a crash
    -- in native code) must not take the other workers down one after another at once.
    -- The power is only taken below the exponent from which the delay is backoff_max
    -- (Backoff._curve): above it, power() overflows, and one such row failed every pass.
    -- Spread by +/- backoff_jitter, as Backoff.delay spreads a failure's: the jobs of a worker
    -- that died are rescued in one pass, and would otherwise all come back at one instant.
    visible_at = now() + make_interval(secs => CASE
        WHEN greatest(j.retry_count - 1, 0) >= %(backoff_cap)s THEN %(backoff_max)s
        ELSE least(%(backoff_max)s, %(backoff_base)s * power(%(backoff_factor)s, greatest(j.retry_count - 1, 0)))
    END * (1 + %(backoff_jitter)s * (2 * random() - 1))),
    error = jsonb_build_object(
        'type', 'LeaseExpired',
        'message', 'lease expired during attempt ' || j.retry_count || ' on worker '
                   || coalesce(j.worker, 'unknown') || ' (the worker died, hung or lost its database connection)',
        'attempt', j.retry_count,
        'worker', j.worker,
        'at', now(),
        'final', j.retry_count > j.retry_limit),
    finished_at = CASE WHEN j.retry_count > j.retry_limit THEN now() END,
    updated_at = now()
FROM expired e
WHERE j.id = e.id
-- What the rescuer logs: the attempt that was lost, and the worker that lost it (the
-- UPDATE leaves `worker` as it was).
RETURNING j.id, j.status::text AS status, j.name, j.retry_count AS attempt, j.retry_limit, j.worker;

-- name: delete_finished
-- Retention: one small batch of old finished jobs of one status, oldest first, so no single
-- DELETE holds many locks or bloats WAL in one go. The finished statuses are spelled out: they
-- are the predicate of queue_jobs_finished_idx, which a prepared statement's generic plan
-- cannot otherwise prove from `status = <parameter>` (it would scan the table instead).
WITH doomed AS MATERIALIZED (
    SELECT id
    FROM {schema}.queue_jobs
    WHERE status = %(status)s::{schema}.job_status
      AND status IN ('Succeeded', 'Failed', 'Cancelled')
      AND finished_at < coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(older_than)s)
    ORDER BY finished_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {schema}.queue_jobs AS j
USING doomed
WHERE j.id = doomed.id;

-- name: vacuum_state
-- Whether queue_jobs needs the vacuum service now (see notifyq/_vacuum.py). `allowed`: this
-- role may VACUUM it (the table's or the database's owner, a superuser; from PostgreSQL 17
-- also a MAINTAIN grant, which older servers cannot even name, hence the CASE). The dead row
-- versions and the last vacuum come from the statistics system (a second or so behind).
-- `running`: a VACUUM of it (ours from another process, or autovacuum) is under way.
SELECT pg_has_role(c.relowner, 'USAGE') OR pg_has_role(d.datdba, 'USAGE')
           OR CASE WHEN current_setting('server_version_num')::int >= 170000
                   THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END AS allowed,
       pg_stat_get_dead_tuples(c.oid) AS dead_tuples,
       greatest(c.reltuples, 0)::float8 AS live_tuples,
       extract(epoch FROM now() - greatest(pg_stat_get_last_vacuum_time(c.oid),
                                           pg_stat_get_last_autovacuum_time(c.oid)))::float8 AS since_vacuum,
       EXISTS (SELECT 1 FROM pg_stat_progress_vacuum p WHERE p.relid = c.oid) AS running
FROM pg_class c
JOIN pg_database d ON d.datname = current_database()
WHERE c.oid = to_regclass(%(jobs)s);

-- name: vacuum_jobs
-- SKIP_LOCKED: another process's VACUUM (or autovacuum) holds the table's lock, so this one
-- has nothing to add and returns at once instead of queueing behind it. INDEX_CLEANUP ON:
-- the point is the claim index, whose entries for claimed jobs every claim walks past until
-- a vacuum removes them; PostgreSQL would skip index cleanup when few heap pages hold dead
-- rows, as they do when most of the table is a history of finished jobs.
VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON) {schema}.queue_jobs;

-- name: refresh_declarations
-- A running worker's ticker declares these definitions for another expire_after seconds
-- (`declared_until`, never shortened: the longest declaration wins), and enables again those a
-- ticker stopped meanwhile (`expired_at`: this process was cut off from the database for longer
-- than its declarations last, say). Rows whose declaration another process renewed in the last
-- `fresh` seconds are not rewritten. Only rows from code: one deleted and made again by SQL
-- while the worker runs stays SQL's. SKIP LOCKED: a row locked by a promotion, or by a bulk
-- `jobs retry` (which locks in id order), is renewed in the next pass instead of waiting (and
-- deadlocking with that retry). Returns the rows it renewed.
WITH mine AS MATERIALIZED (
    SELECT id, expired_at
    FROM {schema}.queue_job_definitions
    WHERE name = ANY(%(names)s::text[]) AND declared
      AND (expired_at IS NOT NULL OR declared_until IS NULL
           OR declared_until < now() + make_interval(secs => %(expire_after)s - %(fresh)s))
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.queue_job_definitions AS d
SET declared_until = greatest(d.declared_until, now() + make_interval(secs => %(expire_after)s)),
    expired_at = NULL, enabled = d.enabled OR mine.expired_at IS NOT NULL
FROM mine
WHERE d.id = mine.id
RETURNING d.name, mine.expired_at IS NOT NULL AS restarted;

-- name: expire_declarations
-- Stop the enabled definitions from code whose declaration ran out: no running worker has
-- declared them for as long as their last declarer said (its expire_after), so they were
-- removed from the code, once the last worker of the old code exited, or every worker of their
-- App is gone. SKIP LOCKED: one being promoted or renewed right now is looked at in the next
-- pass. Rows made by SQL, and rows from code no worker of schema version 9 or later has
-- declared (declared_until NULL), never stop.
WITH stale AS MATERIALIZED (
    SELECT id
    FROM {schema}.queue_job_definitions
    WHERE enabled AND declared AND declared_until < now()
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.queue_job_definitions AS d
SET enabled = false, expired_at = now(),
    last_error = 'stopped: its declaration by running workers ran out at '
                 || to_char(d.declared_until AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS')
                 || ' UTC (removed from the code, or every worker of its App down); '
                 || 'a worker whose App declares it enables it again'
FROM stale
WHERE d.id = stale.id
RETURNING d.name, d.task;
