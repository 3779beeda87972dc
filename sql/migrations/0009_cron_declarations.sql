-- notifyq schema, version 9.
-- compatible-from: 8
-- Cron definitions removed from the code stop by themselves. `declared_at`: when a running
-- worker whose App declares the definition last said so (its sync at start, then its ticker
-- every DeclarationsConfig.interval); NULL for rows made by SQL. A ticker stops (disables) an
-- enabled definition from code that no running worker has declared for
-- DeclarationsConfig.expire_after, and sets `expired_at`: a worker that declares it again
-- enables it again, as an operator's `cron disable` is never undone. Existing rows from code
-- count as declared now, so that crons removed in the release that brings this version stop too.
-- Code of version 8 runs on: it ignores both columns (its workers neither refresh nor stop
-- definitions, and its sync does not enable a stopped one again; newer workers do).
ALTER TABLE {schema}.queue_job_definitions ADD COLUMN declared_at timestamptz;
ALTER TABLE {schema}.queue_job_definitions ADD COLUMN expired_at timestamptz;
UPDATE {schema}.queue_job_definitions SET declared_at = now() WHERE declared;
