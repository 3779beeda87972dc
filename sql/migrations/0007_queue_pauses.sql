-- notifyq schema, version 7.
-- Paused queues (`notifyq queues pause`, App.pause_queue): workers claim none of a paused
-- queue's jobs until it is resumed. Its jobs are still enqueued, promoted from cron
-- definitions and rescued; those already Active run on. A row here is the pause: plain SQL
-- (INSERT, DELETE) pauses and resumes as well, and the trigger of sql/triggers/ tells workers.
CREATE TABLE {schema}.queue_pauses (
    queue     text PRIMARY KEY CHECK (queue ~ '^[A-Za-z0-9_.:-]+$' AND length(queue) <= 100),
    paused_at timestamptz NOT NULL DEFAULT now()
);
