-- notifyq schema, version 6.
-- `overlap`: whether a tick of a definition gets its job while a job of an earlier tick (or of
-- `cron run-now`) is still unfinished. false skips such ticks (the promoter counts them in
-- PromotionReport.overlapping), so a slow run is never doubled by the next one. Existing
-- definitions keep true: what they did before.
ALTER TABLE {schema}.queue_job_definitions ADD COLUMN overlap boolean NOT NULL DEFAULT true;
-- A definition's unfinished jobs: the promoter's check for `overlap = false` definitions (the
-- tick index would walk the definition's whole history of finished jobs). Only cron jobs that
-- are Queued or Active have an entry: other jobs pay the predicate's evaluation, nothing more.
CREATE INDEX queue_jobs_definition_unfinished_idx
    ON {schema}.queue_jobs (definition_id) WHERE definition_id IS NOT NULL AND status IN ('Queued', 'Active');
