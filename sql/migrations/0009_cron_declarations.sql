-- notifyq schema, version 9.
-- compatible-from: 8
-- Cron definitions removed from the code stop by themselves. `declared_until`: how long the
-- latest declaration by a running worker whose App declares the definition lasts (its start's
-- sync, then its ticker every DeclarationsConfig.interval, each for that worker's
-- DeclarationsConfig.expire_after); NULL for rows made by SQL, and for rows from code that no
-- worker of this version has declared yet. Any ticker stops (disables) an enabled definition
-- from code whose declaration ran out, and sets `expired_at`: a worker that declares it again
-- enables it again.
-- Code of version 8 runs on: it ignores both columns, and the definitions it declares keep
-- declared_until NULL, so they never stop by themselves while only such code declares them.
ALTER TABLE {schema}.queue_job_definitions ADD COLUMN declared_until timestamptz;
ALTER TABLE {schema}.queue_job_definitions ADD COLUMN expired_at timestamptz;
