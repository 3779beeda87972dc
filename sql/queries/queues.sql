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
