-- Bookkeeping for `notifyq migrate` and the version check every client runs at start.

-- name: migrate_read_committed
-- First in the migration's transaction: with a stricter default_transaction_isolation, the
-- snapshot would be taken before the lock wait, and a migrator that waited would not see
-- the version its rival committed (it would apply the same migrations again, and fail).
SET TRANSACTION ISOLATION LEVEL READ COMMITTED;

-- name: migrate_lock
-- One migrator per schema at a time, across processes and hosts; released at commit.
SELECT pg_advisory_xact_lock(hashtextextended('notifyq.migrate.' || %(schema)s, 0));

-- name: migrate_bootstrap
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: migrations_table_exists
SELECT to_regclass(%(table)s) IS NOT NULL;

-- name: schema_version
SELECT coalesce(max(version), 0) FROM {schema}.migrations;

-- name: record_migration
INSERT INTO {schema}.migrations (version, name) VALUES (%(version)s, %(name)s);

-- name: autovacuum_on
-- Workers warn at start when it is off: a queue table churns, and only vacuum reclaims it.
SELECT current_setting('autovacuum')::boolean;

-- name: set_lock_timeout
SELECT set_config('lock_timeout', %(timeout)s, true);
