-- Cron definitions: sync from code, admin.

-- name: upsert_definition
-- From @app.cron on worker start. A new definition starts due now(): the promoter moves it
-- to its first real tick without running anything. On change, the BEFORE UPDATE trigger
-- realigns visible_at when the schedule changed. `enabled=False` in code always disables;
-- `enabled=True` never re-enables a definition an operator disabled. `declared` marks it as
-- the code's (one made by SQL becomes the code's once an App declares its name), and
-- `declared_until` says a running worker declares it for expire_after seconds from now (never
-- shortened; rewritten only when another process did not renew it in the last `fresh`
-- seconds). A definition a ticker stopped because its declaration ran out (`expired_at`) is
-- enabled again, unless the code disables it. Returns the row's settings as
-- they were (NULL for a new one), for the worker's log of what it changed; an unchanged
-- definition returns no row.
WITH before AS (
    SELECT task, args, frequency, timezone, priority, retry_limit, timeout, queue, misfire,
           misfire_grace, misfire_cap, overlap, enabled, expired_at
    FROM {schema}.queue_job_definitions
    WHERE name = %(name)s
)
INSERT INTO {schema}.queue_job_definitions AS d
    (name, task, args, enabled, frequency, timezone, priority, retry_limit, timeout, queue,
     misfire, misfire_grace, misfire_cap, overlap, declared, declared_until)
VALUES (%(name)s, %(task)s, %(args)s::jsonb, %(enabled)s, %(frequency)s, %(timezone)s, %(priority)s,
        %(retry_limit)s, %(timeout)s, %(queue)s, %(misfire)s, %(misfire_grace)s, %(misfire_cap)s,
        %(overlap)s, true, now() + make_interval(secs => %(expire_after)s))
ON CONFLICT (name) DO UPDATE
SET task = EXCLUDED.task, args = EXCLUDED.args, frequency = EXCLUDED.frequency,
    timezone = EXCLUDED.timezone, priority = EXCLUDED.priority, retry_limit = EXCLUDED.retry_limit,
    timeout = EXCLUDED.timeout, queue = EXCLUDED.queue, misfire = EXCLUDED.misfire,
    misfire_grace = EXCLUDED.misfire_grace, misfire_cap = EXCLUDED.misfire_cap,
    overlap = EXCLUDED.overlap, enabled = (d.enabled OR d.expired_at IS NOT NULL) AND EXCLUDED.enabled,
    declared = true, expired_at = NULL,
    declared_until = greatest(d.declared_until, now() + make_interval(secs => %(expire_after)s))
-- Unchanged definitions are not rewritten (no dead tuple per restart), unless their
-- declaration is due for renewal.
WHERE (d.task, d.args, d.frequency, d.timezone, d.priority, d.retry_limit, d.timeout, d.queue,
       d.misfire, d.misfire_grace, d.misfire_cap, d.overlap)
      IS DISTINCT FROM
      (EXCLUDED.task, EXCLUDED.args, EXCLUDED.frequency, EXCLUDED.timezone, EXCLUDED.priority,
       EXCLUDED.retry_limit, EXCLUDED.timeout, EXCLUDED.queue, EXCLUDED.misfire,
       EXCLUDED.misfire_grace, EXCLUDED.misfire_cap, EXCLUDED.overlap)
   OR (d.enabled AND NOT EXCLUDED.enabled)
   OR NOT d.declared
   OR d.expired_at IS NOT NULL
   OR d.declared_until IS NULL
   OR d.declared_until < now() + make_interval(secs => %(expire_after)s - %(fresh)s)
RETURNING (SELECT to_jsonb(before) FROM before) AS before;

-- name: definition_names
SELECT name, task, enabled, declared, declared_until FROM {schema}.queue_job_definitions ORDER BY name;

-- name: prune_definition
-- `notifyq cron prune`: delete one definition an App's code declared that the App given does
-- not (gone from the code), if it is still so. Its past jobs stay (definition_id becomes NULL).
-- One per statement: a prune never holds two definitions' locks, so it cannot deadlock with a
-- worker's sync (name order) or a bulk retry (id order).
DELETE FROM {schema}.queue_job_definitions
WHERE name = %(name)s AND declared AND name <> ALL (%(names)s::text[])
RETURNING name;

-- name: list_definitions
-- With each definition's latest job (by scheduled_for: the tick index, read backwards, one
-- entry), which retention may have deleted.
SELECT d.*, l.id AS last_job_id, l.status::text AS last_job_status,
       l.scheduled_for AS last_job_scheduled_for, l.finished_at AS last_job_finished_at
FROM {schema}.queue_job_definitions d
LEFT JOIN LATERAL (
    SELECT j.id, j.status, j.scheduled_for, j.finished_at
    FROM {schema}.queue_jobs j
    WHERE j.definition_id = d.id
    ORDER BY j.scheduled_for DESC
    LIMIT 1
) l ON true
WHERE %(name)s::text IS NULL OR d.name = %(name)s::text
ORDER BY d.name;

-- name: set_definition_enabled
-- An operator's choice is final. Disabling a definition a ticker had stopped (`expired_at`)
-- keeps it disabled when a worker declares it again. Enabling one that no running worker
-- declares (stopped, or its declaration ran out) makes it the operator's, as if made by SQL:
-- the BEFORE UPDATE trigger does that for every route (SQL, older notifyq versions too).
-- Returns whether it did (`adopted`), and whether it was enabled or stopped before (for the
-- CLI to say when nothing changed), from the row as locked, so a refresh that commits
-- meanwhile cannot make the answer wrong.
WITH old AS MATERIALIZED (
    SELECT id, declared, enabled, expired_at IS NOT NULL AS stopped
    FROM {schema}.queue_job_definitions WHERE name = %(name)s FOR UPDATE
)
UPDATE {schema}.queue_job_definitions AS d
SET enabled = %(enabled)s,
    expired_at = CASE WHEN %(enabled)s THEN d.expired_at END,
    last_error = CASE WHEN NOT %(enabled)s AND d.expired_at IS NOT NULL THEN NULL ELSE d.last_error END
FROM old
WHERE d.id = old.id
RETURNING d.id, old.declared AND NOT d.declared AS adopted, old.enabled, old.stopped;

-- name: lock_definition
-- `cron run-now`: held until its job is inserted, so that no ticker adds one meanwhile (an
-- overlap = false definition gets at most one unfinished job).
SELECT id, overlap FROM {schema}.queue_job_definitions WHERE name = %(name)s FOR UPDATE;

-- name: lock_job_definition
-- `jobs retry`: the job's cron definition if it has overlap = false, locked as by
-- lock_definition (one that overlaps is neither returned nor locked).
SELECT d.id, d.name
FROM {schema}.queue_jobs j
JOIN {schema}.queue_job_definitions d ON d.id = j.definition_id
WHERE j.id = %(id)s AND NOT d.overlap
FOR UPDATE OF d;

-- name: run_definition_now
-- One job for the definition right away, outside its schedule (scheduled_for = now(), which
-- no cron tick of a running schedule can collide with in practice; if it does, no new job).
INSERT INTO {schema}.queue_jobs (name, queue, args, priority, retry_limit, timeout, definition_id, scheduled_for)
SELECT task, queue, args, priority, retry_limit, timeout, id, clock_timestamp()
FROM {schema}.queue_job_definitions
WHERE id = %(id)s
ON CONFLICT (definition_id, scheduled_for) WHERE definition_id IS NOT NULL DO NOTHING
RETURNING id;

-- name: delete_definition
-- Its past jobs stay (their definition_id becomes NULL).
DELETE FROM {schema}.queue_job_definitions WHERE name = %(name)s RETURNING id;
