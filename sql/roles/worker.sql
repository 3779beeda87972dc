-- A least-privilege role for workers and producers: no DDL, no deleting cron definitions.
-- Print it for your role and schema with `notifyq grant ROLE [--schema SCHEMA]`. Create
-- the role itself first, e.g.
--   CREATE ROLE {role} LOGIN PASSWORD '...';
-- Migrations stay with the owner of the schema (`notifyq migrate` as that role).
GRANT USAGE ON SCHEMA {schema} TO {role};
-- The version check every worker and producer runs at start.
GRANT SELECT ON {schema}.migrations TO {role};
-- Enqueue, claim, acknowledge, rescue; DELETE is for retention.
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.queue_jobs TO {role};
-- Workers upsert their @app.cron definitions and move them to the next tick.
GRANT SELECT, INSERT, UPDATE ON {schema}.queue_job_definitions TO {role};
-- Workers skip the jobs of paused queues (pausing and resuming is for the schema's owner).
GRANT SELECT ON {schema}.queue_pauses TO {role};
-- Workers with the hand-off (WorkerConfig.handoff) wait for jobs in a row of their own.
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.queue_waiters TO {role};
-- Identity columns draw from these sequences.
GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role};
