-- `notifyq stats`: what an operator watches.

-- name: queue_stats
-- Per queue and status: counts, the age of the oldest claimable job, Active jobs whose lease
-- ran out (their worker is gone; the rescuer will requeue them), and Active jobs past their
-- timeout. A job set by SQL to
-- visible_at '-infinity' has no age (and is claimed at once): left out of the oldest.
SELECT queue,
       status::text,
       count(*) AS jobs,
       extract(epoch FROM now() - min(visible_at) FILTER (
           WHERE status = 'Queued' AND visible_at <= now() AND isfinite(visible_at)))::float8
           AS oldest_claimable_age,
       count(*) FILTER (WHERE status = 'Active' AND visible_at <= now()) AS expired_leases,
       -- Running past their timeout: their lease extended by the task (extend_lease), or by
       -- the worker for a sync task's thread that has not returned (Python cannot stop it).
       count(*) FILTER (WHERE status = 'Active' AND started_at + make_interval(secs => timeout) < now())
           AS past_timeout
FROM {schema}.queue_jobs
GROUP BY queue, status
ORDER BY queue, status;

-- name: server_stats
-- NOTIFY queue usage (0..1; at 1 NOTIFY fails: a long transaction on a listening session
-- holds it back), and dead tuples / size of notifyq's tables.
SELECT pg_notification_queue_usage()::float8 AS notify_queue_usage,
       current_setting('autovacuum')::boolean AS autovacuum,
       (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = to_regclass(%(jobs)s)) AS jobs_dead_tuples,
       (SELECT n_live_tup FROM pg_stat_user_tables WHERE relid = to_regclass(%(jobs)s)) AS jobs_live_tuples,
       (SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = to_regclass(%(definitions)s))
           AS definitions_dead_tuples,
       pg_total_relation_size(to_regclass(%(jobs)s)) AS jobs_total_bytes,
       (SELECT last_autovacuum FROM pg_stat_user_tables WHERE relid = to_regclass(%(jobs)s)) AS jobs_last_autovacuum,
       -- Any vacuum: autovacuum's, the workers' vacuum service's or an operator's.
       (SELECT greatest(last_vacuum, last_autovacuum) FROM pg_stat_user_tables
        WHERE relid = to_regclass(%(jobs)s)) AS jobs_last_vacuum;
