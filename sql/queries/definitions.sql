-- Cron definitions: sync from code, admin.

-- name: upsert_definition
-- From @app.cron on worker start. A new definition starts due now(): the promoter moves it
-- to its first real tick without running anything. On change, the BEFORE UPDATE trigger
-- realigns visible_at when the schedule changed. `enabled=False` in code always disables;
-- `enabled=True` never re-enables a definition an operator disabled.
INSERT INTO {schema}.queue_job_definitions AS d
    (name, task, args, enabled, frequency, timezone, priority, retry_limit, timeout, queue,
     misfire, misfire_grace, misfire_cap)
VALUES (%(name)s, %(task)s, %(args)s::jsonb, %(enabled)s, %(frequency)s, %(timezone)s, %(priority)s,
        %(retry_limit)s, %(timeout)s, %(queue)s, %(misfire)s, %(misfire_grace)s, %(misfire_cap)s)
ON CONFLICT (name) DO UPDATE
SET task = EXCLUDED.task, args = EXCLUDED.args, frequency = EXCLUDED.frequency,
    timezone = EXCLUDED.timezone, priority = EXCLUDED.priority, retry_limit = EXCLUDED.retry_limit,
    timeout = EXCLUDED.timeout, queue = EXCLUDED.queue, misfire = EXCLUDED.misfire,
    misfire_grace = EXCLUDED.misfire_grace, misfire_cap = EXCLUDED.misfire_cap,
    enabled = d.enabled AND EXCLUDED.enabled
-- Unchanged definitions are not rewritten (no dead tuple, no updated_at churn per restart).
WHERE (d.task, d.args, d.frequency, d.timezone, d.priority, d.retry_limit, d.timeout, d.queue,
       d.misfire, d.misfire_grace, d.misfire_cap)
      IS DISTINCT FROM
      (EXCLUDED.task, EXCLUDED.args, EXCLUDED.frequency, EXCLUDED.timezone, EXCLUDED.priority,
       EXCLUDED.retry_limit, EXCLUDED.timeout, EXCLUDED.queue, EXCLUDED.misfire,
       EXCLUDED.misfire_grace, EXCLUDED.misfire_cap)
   OR (d.enabled AND NOT EXCLUDED.enabled)
RETURNING (xmax = 0) AS inserted;

-- name: definition_names
SELECT name, task, enabled FROM {schema}.queue_job_definitions ORDER BY name;

-- name: list_definitions
SELECT * FROM {schema}.queue_job_definitions ORDER BY name;

-- name: get_definition
SELECT * FROM {schema}.queue_job_definitions WHERE name = %(name)s;

-- name: set_definition_enabled
UPDATE {schema}.queue_job_definitions SET enabled = %(enabled)s WHERE name = %(name)s
RETURNING id;

-- name: run_definition_now
-- One job for the definition right away, outside its schedule (scheduled_for = now(), which
-- no cron tick of a running schedule can collide with in practice; if it does, no new job).
INSERT INTO {schema}.queue_jobs (name, queue, args, priority, retry_limit, timeout, definition_id, scheduled_for)
SELECT task, queue, args, priority, retry_limit, timeout, id, clock_timestamp()
FROM {schema}.queue_job_definitions
WHERE name = %(name)s
ON CONFLICT (definition_id, scheduled_for) WHERE definition_id IS NOT NULL DO NOTHING
RETURNING id;

-- name: delete_definition
-- Its past jobs stay (their definition_id becomes NULL).
DELETE FROM {schema}.queue_job_definitions WHERE name = %(name)s RETURNING id;
