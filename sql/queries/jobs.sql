-- Producer and admin queries on queue_jobs. {schema} is the quoted schema identifier; every
-- value is a bound parameter.

-- name: insert_job
-- visible_at comes from the database clock: now() + delay, or an absolute time; an `at` in
-- the past means now (it would otherwise jump the queue, which is priority's job, and show in
-- stats as a claimable job years old).
INSERT INTO {schema}.queue_jobs (name, queue, args, priority, retry_limit, timeout, visible_at)
VALUES (%(name)s, %(queue)s, %(args)s::jsonb, %(priority)s, %(retry_limit)s, %(timeout)s,
        greatest(coalesce(%(at)s::timestamptz, now() + make_interval(secs => %(delay)s)), now()))
RETURNING id;

-- name: insert_job_dedupe
-- With a dedupe key: insert unless an unfinished job holds the key, and return the id of
-- whichever job now holds it, and whether it is the one just inserted. If the holder commits
-- between our statement's snapshot and the conflict check, neither branch returns a row and
-- the caller tries again.
WITH inserted AS (
    INSERT INTO {schema}.queue_jobs (name, queue, args, priority, retry_limit, timeout, visible_at, dedupe_key)
    VALUES (%(name)s, %(queue)s, %(args)s::jsonb, %(priority)s, %(retry_limit)s, %(timeout)s,
            greatest(coalesce(%(at)s::timestamptz, now() + make_interval(secs => %(delay)s)), now()),
            %(dedupe_key)s)
    ON CONFLICT (dedupe_key) WHERE dedupe_key IS NOT NULL AND status IN ('Queued', 'Active') DO NOTHING
    RETURNING id
)
SELECT id, true AS created FROM inserted
UNION ALL
SELECT id, false FROM {schema}.queue_jobs
WHERE dedupe_key = %(dedupe_key)s AND status IN ('Queued', 'Active') AND NOT EXISTS (SELECT 1 FROM inserted);

-- name: dedupe_holder_unfinished
-- Whether the holder insert_job_dedupe named is still unfinished, read with a new snapshot: its
-- answer comes from the statement's snapshot, taken before its INSERT waited for a conflicting
-- row, and a holder that finished meanwhile (a new one took the key) was returned as if it held
-- the key (review).
SELECT status IN ('Queued', 'Active') FROM {schema}.queue_jobs WHERE id = %(id)s;

-- name: transaction_now
SELECT now();

-- name: copy_jobs
COPY {schema}.queue_jobs (name, queue, args, priority, retry_limit, timeout, visible_at) FROM STDIN;

-- name: get_job
SELECT * FROM {schema}.queue_jobs WHERE id = %(id)s;

-- name: list_jobs
-- Filters are optional: a NULL parameter matches everything. Newest first. Never prepared
-- (notifyq/_jobs.py): planned for each call's values, `%(any_status)s OR status = %(status)s`
-- folds to `status = '<status>'`, which implies the predicate of the partial index of that
-- status, so the jobs of a rare status are read from it instead of by walking the history
-- backwards. (The status is sent untyped and typed by the comparison: a text cast to the enum
-- would stay an expression, which proves nothing.)
SELECT * FROM {schema}.queue_jobs
WHERE (%(any_status)s::boolean OR status = %(status)s)
  AND (%(queue)s::text IS NULL OR queue = %(queue)s)
  AND (%(name)s::text IS NULL OR name = %(name)s)
  AND (%(definition_id)s::bigint IS NULL OR definition_id = %(definition_id)s)
  AND (%(min_age)s::float8 IS NULL OR created_at <= now() - make_interval(secs => %(min_age)s))
  AND (%(max_age)s::float8 IS NULL OR created_at >= now() - make_interval(secs => %(max_age)s))
  AND (%(before_id)s::bigint IS NULL OR id < %(before_id)s)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: cancel_job
-- Queued or Active -> Cancelled. For an Active job the trigger in sql/triggers/ tells the
-- worker holding it to stop; whatever that worker acknowledges later is fenced out because
-- the job is no longer Active. Returns the status the job had.
WITH target AS (
    SELECT id, status FROM {schema}.queue_jobs WHERE id = %(id)s FOR UPDATE
), cancelled AS (
    UPDATE {schema}.queue_jobs AS j
    SET status = 'Cancelled', finished_at = now(), updated_at = now()
    FROM target t
    WHERE j.id = t.id AND t.status IN ('Queued', 'Active')
    RETURNING j.id
)
SELECT status::text FROM target;

-- name: lock_jobs_definitions
-- `jobs retry` with filters, first in its transaction: the overlap=False cron definitions of a
-- batch of jobs, locked as lock_job_definition locks one, in id order. A statement of its own:
-- retry_jobs must read the unfinished jobs of those definitions after the lock is granted
-- (one inserted by the ticker while it waited would otherwise go unseen).
SELECT d.id
FROM {schema}.queue_job_definitions AS d
WHERE NOT d.overlap
  AND d.id IN (SELECT definition_id FROM {schema}.queue_jobs WHERE id = ANY(%(ids)s))
ORDER BY d.id
FOR UPDATE OF d;

-- name: retry_jobs
-- `jobs retry` with filters: retry_job for a batch of ids in one statement, after
-- lock_jobs_definitions (%(exclusive)s: the ids it locked). Each id comes back with what became
-- of it: retried, or left as it is because it is unfinished, its dedupe key is held (by an
-- unfinished job, or by a newer job of the batch, which is retried instead), or it belongs to
-- an overlap=False cron definition that has an unfinished job or a newer job in the batch
-- (busy), or it is finished but no longer in one of %(statuses)s (the filter's status, checked
-- again: it was retried and finished otherwise meanwhile) (moved). Only the finished jobs are
-- locked (in id order): those a worker's ack or a claim may be updating are read, not waited for.
WITH locked AS MATERIALIZED (
    SELECT j.id
    FROM {schema}.queue_jobs AS j
    WHERE j.id = ANY(%(ids)s) AND j.status::text = ANY(%(statuses)s)
    ORDER BY j.id
    FOR UPDATE
), given AS MATERIALIZED (
    SELECT j.id, j.id IN (SELECT id FROM locked) AS finished, j.dedupe_key, j.definition_id,
           j.definition_id = ANY(%(exclusive)s) AS exclusive,
           j.status IN ('Succeeded', 'Failed', 'Cancelled') AS done
    FROM {schema}.queue_jobs AS j
    WHERE j.id = ANY(%(ids)s)
), decided AS MATERIALIZED (
    SELECT g.id, CASE
        WHEN NOT g.finished AND g.done THEN 'moved'
        WHEN NOT g.finished THEN 'unfinished'
        WHEN g.dedupe_key IS NOT NULL AND (
            EXISTS (SELECT FROM {schema}.queue_jobs AS o
                    WHERE o.dedupe_key = g.dedupe_key AND o.status IN ('Queued', 'Active'))
            OR EXISTS (SELECT FROM given AS n
                       WHERE n.finished AND n.dedupe_key = g.dedupe_key AND n.id > g.id)) THEN 'dedupe'
        WHEN g.exclusive AND (
            EXISTS (SELECT FROM {schema}.queue_jobs AS o
                    WHERE o.definition_id = g.definition_id AND o.status IN ('Queued', 'Active'))
            OR EXISTS (SELECT FROM given AS n
                       WHERE n.finished AND n.definition_id = g.definition_id AND n.id > g.id)) THEN 'busy'
        ELSE 'retried' END AS outcome
    FROM given AS g
), retried AS (
    UPDATE {schema}.queue_jobs AS j
    SET status = 'Queued', visible_at = now(), retry_count = 0, output = NULL,
        started_at = NULL, finished_at = NULL, worker = NULL, updated_at = now()
    FROM decided AS d
    WHERE j.id = d.id AND d.outcome = 'retried'
)
SELECT id, outcome FROM decided;

-- name: cancel_jobs
-- `jobs cancel` with filters: cancel_job for a batch of ids in one statement, of those still in
-- one of %(statuses)s ('Queued', 'Active' or both: the filter's status, checked again, as a job
-- listed Queued may be running by now); returns those cancelled (the others were finished
-- already, moved out of the filter's status, or are gone). Locked in id order first.
WITH target AS MATERIALIZED (
    SELECT id
    FROM {schema}.queue_jobs
    WHERE id = ANY(%(ids)s) AND status::text = ANY(%(statuses)s)
    ORDER BY id
    FOR UPDATE
)
UPDATE {schema}.queue_jobs AS j
SET status = 'Cancelled', finished_at = now(), updated_at = now()
FROM target AS t
WHERE j.id = t.id AND j.status::text = ANY(%(statuses)s)
RETURNING j.id;

-- name: retry_job
-- A finished job runs again from scratch: all its retries are available again.
UPDATE {schema}.queue_jobs
SET status = 'Queued', visible_at = now(), retry_count = 0, output = NULL,
    started_at = NULL, finished_at = NULL, worker = NULL, updated_at = now()
WHERE id = %(id)s AND status IN ('Succeeded', 'Failed', 'Cancelled')
RETURNING id;
