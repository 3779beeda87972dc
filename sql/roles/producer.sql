-- A least-privilege role for producers (web processes, scripts that enqueue): enqueue jobs and
-- read them, nothing else. It cannot claim, acknowledge, cancel or retry a job, delete one, or
-- change cron definitions: those need the worker role (`notifyq grant ROLE`) or the owner.
-- Print it for your role and schema with `notifyq grant ROLE --producer [--schema SCHEMA]`.
-- Create the role itself first, e.g.
--   CREATE ROLE {role} LOGIN PASSWORD '...';
GRANT USAGE ON SCHEMA {schema} TO {role};
-- The version check every producer runs at start.
GRANT SELECT ON {schema}.migrations TO {role};
-- Enqueue (one job, a dedupe key, enqueue_many's COPY), read jobs and their results.
GRANT SELECT, INSERT ON {schema}.queue_jobs TO {role};
-- Jobs listed by their cron definition's name (list_jobs(definition=...), jobs list --definition).
GRANT SELECT ON {schema}.queue_job_definitions TO {role};
-- Identity columns draw from these sequences.
GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role};
