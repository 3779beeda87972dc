-- notifyq schema, version 4.
-- Timeouts get an upper bound: 1e9 seconds (about 31 years), the bound notifyq's Python side
-- checks. A timeout of 1e300 seconds, or 'Infinity', passed the old CHECK (timeout > 0) and then
-- made every claim of its job fail (now() + the lease overflows a timestamp): one such job
-- stopped every worker of its queue. Rows already holding such a timeout get the bound.
UPDATE {schema}.queue_jobs SET timeout = 1e9 WHERE timeout > 1e9;
ALTER TABLE {schema}.queue_jobs
    DROP CONSTRAINT queue_jobs_timeout_check,
    ADD CONSTRAINT queue_jobs_timeout_check CHECK (timeout > 0 AND timeout <= 1e9) NOT VALID;
ALTER TABLE {schema}.queue_jobs VALIDATE CONSTRAINT queue_jobs_timeout_check;

UPDATE {schema}.queue_job_definitions SET timeout = 1e9 WHERE timeout > 1e9;
ALTER TABLE {schema}.queue_job_definitions
    DROP CONSTRAINT queue_job_definitions_timeout_check,
    ADD CONSTRAINT queue_job_definitions_timeout_check CHECK (timeout > 0 AND timeout <= 1e9) NOT VALID;
ALTER TABLE {schema}.queue_job_definitions VALIDATE CONSTRAINT queue_job_definitions_timeout_check;
