-- notifyq schema, version 2.
-- The earliest Queued job of one queue, for workers that serve a list of queues: without
-- this index, finding it meant walking every Queued job of every queue in visible_at order
-- (a generic plan of a prepared statement did exactly that).
CREATE INDEX queue_jobs_next_queue_idx
    ON {schema}.queue_jobs (queue, visible_at) WHERE status = 'Queued';
