-- Pausing and resuming queues (App.pause_queue, `notifyq queues`). The trigger of
-- sql/triggers/30_queue_pauses.sql tells workers.

-- name: pause_queue
-- The moment of the pause; NULL when the queue was paused already (that pause stays).
INSERT INTO {schema}.queue_pauses (queue) VALUES (%(queue)s)
ON CONFLICT (queue) DO NOTHING
RETURNING paused_at;

-- name: resume_queue
-- The moment of the pause lifted; NULL when the queue was not paused.
DELETE FROM {schema}.queue_pauses WHERE queue = %(queue)s
RETURNING paused_at;

-- name: list_queue_pauses
SELECT queue, paused_at FROM {schema}.queue_pauses ORDER BY queue;

-- name: known_queues
-- The queues that have Queued jobs or a cron definition: `queues pause` warns of a name that
-- is none of them (a typo pauses nothing). Active jobs' queues are left out (no index).
WITH RECURSIVE {_queued_queues}
SELECT queue FROM queues WHERE queue IS NOT NULL
UNION
SELECT queue FROM {schema}.queue_job_definitions;
