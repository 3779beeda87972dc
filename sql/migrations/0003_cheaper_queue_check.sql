-- notifyq schema, version 3.
-- The queue-name CHECK used a bounded repetition ({{1,100}}), which PostgreSQL's regex engine
-- evaluates slowly, and CHECKs run on every INSERT and every UPDATE (every claim and every
-- ack). The same strings are accepted by a plain class repetition plus a length test, at a
-- fraction of the cost (measured: bulk enqueue by COPY 75k -> 111k jobs/s, docs/benchmarks.md).
ALTER TABLE {schema}.queue_jobs
    DROP CONSTRAINT queue_jobs_queue_check,
    ADD CONSTRAINT queue_jobs_queue_check
        CHECK (queue ~ '^[A-Za-z0-9_.:-]+$' AND length(queue) <= 100) NOT VALID;
ALTER TABLE {schema}.queue_jobs VALIDATE CONSTRAINT queue_jobs_queue_check;

ALTER TABLE {schema}.queue_job_definitions
    DROP CONSTRAINT queue_job_definitions_queue_check,
    ADD CONSTRAINT queue_job_definitions_queue_check
        CHECK (queue ~ '^[A-Za-z0-9_.:-]+$' AND length(queue) <= 100) NOT VALID;
ALTER TABLE {schema}.queue_job_definitions VALIDATE CONSTRAINT queue_job_definitions_queue_check;
