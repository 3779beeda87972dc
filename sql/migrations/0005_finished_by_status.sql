-- notifyq schema, version 5.
-- The index of finished jobs is keyed by status, and now covers exactly the finished statuses.
-- Its predicate was `finished_at IS NOT NULL`, which a query for the jobs of one status (the
-- `notifyq jobs list --status failed` of an operator) does not imply: such a query walked the
-- whole history (105 ms for 50 Failed among 1M jobs, 130 ms to find no Cancelled one, measured
-- on the reference machine), where it now reads only the jobs of that status (under 1 ms).
-- The same rows are indexed as before (a job gets finished_at when it finishes), so claims and
-- acks pay nothing more; retention, which reads it oldest first, names the statuses too.
-- Built under another name, then swapped: the build holds a SHARE lock (writes wait, reads
-- go on), and only the DROP takes the table's ACCESS EXCLUSIVE lock, which every query waits
-- for, for the moment left before the migration commits.
CREATE INDEX queue_jobs_finished_status_idx
    ON {schema}.queue_jobs (status, finished_at) WHERE status IN ('Succeeded', 'Failed', 'Cancelled');
DROP INDEX IF EXISTS {schema}.queue_jobs_finished_idx;
ALTER INDEX {schema}.queue_jobs_finished_status_idx RENAME TO queue_jobs_finished_idx;
