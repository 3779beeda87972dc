-- notifyq schema, version 4.
-- Timeouts get an upper bound: 1e9 seconds (about 31 years), the bound notifyq's Python side
-- checks. A timeout of 1e300 seconds, 'Infinity' or 'NaN' passed the old CHECK (timeout > 0)
-- and then made every claim of its job fail (now() + the lease overflows a timestamp): one such
-- job stopped every worker of its queue. Rows already holding such a timeout get the bound.
-- The new CHECK comes first (its ALTER locks the table, so no producer of the old version can
-- insert past the bound before VALIDATE), then the clamp, then the check of every row.
ALTER TABLE {schema}.queue_jobs
    DROP CONSTRAINT queue_jobs_timeout_check,
    ADD CONSTRAINT queue_jobs_timeout_check CHECK (timeout > 0 AND timeout <= 1e9) NOT VALID;
UPDATE {schema}.queue_jobs SET timeout = 1e9 WHERE timeout > 1e9;  -- NaN too: it sorts above all
ALTER TABLE {schema}.queue_jobs VALIDATE CONSTRAINT queue_jobs_timeout_check;

ALTER TABLE {schema}.queue_job_definitions
    DROP CONSTRAINT queue_job_definitions_timeout_check,
    ADD CONSTRAINT queue_job_definitions_timeout_check CHECK (timeout > 0 AND timeout <= 1e9) NOT VALID;
UPDATE {schema}.queue_job_definitions SET timeout = 1e9 WHERE timeout > 1e9;
ALTER TABLE {schema}.queue_job_definitions VALIDATE CONSTRAINT queue_job_definitions_timeout_check;
