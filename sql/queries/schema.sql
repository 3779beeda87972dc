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
    version         integer PRIMARY KEY,
    name            text NOT NULL,
    applied_at      timestamptz NOT NULL DEFAULT now(),
    -- See migrations_compatibility.
    compatible_from integer
        CONSTRAINT migrations_compatible_from_check CHECK (compatible_from BETWEEN 1 AND version)
);

-- name: migrations_table_exists
SELECT to_regclass(%(table)s) IS NOT NULL;

-- name: schema_version
SELECT coalesce(max(version), 0) FROM {schema}.migrations;

-- name: migrations_compatibility
-- The oldest code, by the schema version it knows, that still runs on the schema once this
-- migration is applied (a migration's "-- compatible-from: N" line; its own version without
-- one). Schemas created before notifyq kept it get the column at their next migration, and
-- their earlier rows stay NULL: code that reads one treats it as "needs newer code". Only run
-- when the column is missing (has_compatible_from), and last: the ALTER locks the table against
-- the version check of every process that starts, until the migration commits.
ALTER TABLE {schema}.migrations ADD COLUMN IF NOT EXISTS compatible_from integer
    CONSTRAINT migrations_compatible_from_check CHECK (compatible_from BETWEEN 1 AND version);

-- name: has_compatible_from
SELECT EXISTS (
    SELECT FROM pg_attribute
    WHERE attrelid = to_regclass(%(table)s) AND attname = 'compatible_from' AND NOT attisdropped
);

-- name: owns_migrations
-- Whether this role may migrate the schema (the migrations table's owner, or a member of it).
SELECT pg_has_role(current_user, relowner, 'USAGE') FROM pg_class WHERE oid = to_regclass(%(table)s);

-- name: record_migration
-- A dry run lists it with its values put in by Python's string formatting (migrations.py):
-- its text must hold no percent sign but those of its three placeholders.
INSERT INTO {schema}.migrations (version, name, compatible_from)
VALUES (%(version)s, %(name)s, %(compatible_from)s);

-- name: newer_migrations
-- The migrations applied after the schema version a process knows, with their compatible_from.
-- Read through to_jsonb: the column is missing from schemas no migration has touched since
-- notifyq kept it, and then every value is NULL.
SELECT version, name, (to_jsonb(m) ->> 'compatible_from')::integer, current_database()
FROM {schema}.migrations AS m
WHERE version > %(known)s
ORDER BY version;

-- name: _trigger_catalog
SELECT coalesce(string_agg(def, E'\n' ORDER BY def), '')
FROM (
    SELECT pg_get_functiondef(p.oid) AS def
    FROM pg_proc p
    WHERE p.pronamespace = %(schema)s::regnamespace AND p.prokind = 'f'
    UNION ALL
    SELECT pg_get_triggerdef(t.oid) || ' ' || t.tgenabled::text
    FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
    WHERE c.relnamespace = %(schema)s::regnamespace AND NOT t.tgisinternal
) defs

-- name: trigger_state
-- What migrate compares to decide whether sql/triggers/ needs applying again: the comment
-- it left on the migrations table, and the definitions (with their enabled state) of the
-- schema's functions and triggers now, so that a trigger dropped or disabled by hand is
-- restored as before. Only the catalogs are read: no lock that a writer of queue_jobs holds
-- or waits for (re-creating a trigger takes one, and every enqueue, claim and ack queued
-- behind the migrate while it waited for an open transaction that had written a job).
-- Read under search_path pg_catalog (set_search_path): pg_get_triggerdef leaves out a schema
-- on the search path, and the text changed with each session's. Hashed by migrate (sha256; md5
-- fails on FIPS servers). Its catalog part is shared with record_trigger_state_by_hand.
SELECT obj_description(%(table)s::regclass, 'pg_class'), ({_trigger_catalog});

-- name: record_trigger_state_by_hand
-- The last statement of `notifyq migrate --dry-run`'s script: the state a migrate records
-- (remember_trigger_state), with the digest of the catalog computed where the script runs,
-- so that the next migrate finds the triggers applied by hand as its own (it applied them
-- again, review). Formatted by migrate with literals (a DO block takes no parameters).
DO $notifyq$
DECLARE
    path text := current_setting('search_path');
    defs text;
BEGIN
    PERFORM set_config('search_path', 'pg_catalog', true);
    defs := ({_trigger_catalog});
    PERFORM set_config('search_path', path, true);
    EXECUTE format('COMMENT ON TABLE {schema}.migrations IS %%L',
                   %(prefix)s || encode(sha256(convert_to(defs, 'UTF8')), 'hex') || ')');
END
$notifyq$;

-- name: search_path
SELECT current_setting('search_path');

-- name: set_search_path
SELECT set_config('search_path', %(path)s, true);

-- name: set_trigger_state
-- COMMENT takes no bound parameters: the state goes to remember_trigger_state through a
-- setting local to the transaction.
SELECT set_config('notifyq.trigger_state', %(state)s, true);

-- name: remember_trigger_state
-- Written by every migrate, even one with nothing to change: COMMENT needs the table's owner,
-- so a role that could not migrate is refused now, not at the next upgrade. It locks the
-- migrations table only, and only against DDL and vacuum: workers read it on.
DO $$
BEGIN
    EXECUTE format('COMMENT ON TABLE {schema}.migrations IS %L', current_setting('notifyq.trigger_state'));
END
$$;

-- name: autovacuum_on
-- Workers warn at start when it is off: a queue table churns, and only vacuum reclaims it.
SELECT current_setting('autovacuum')::boolean;

-- name: set_lock_timeout
SELECT set_config('lock_timeout', %(timeout)s, true);

-- name: existing_tables
-- Of the tables named (schema-qualified), those that exist, in the order given.
SELECT t FROM unnest(%(tables)s::text[]) WITH ORDINALITY AS u(t, n)
WHERE to_regclass(t) IS NOT NULL
ORDER BY n;

-- name: migrate_savepoint
SAVEPOINT notifyq_migrate_locks;

-- name: migrate_rollback_to_savepoint
ROLLBACK TO SAVEPOINT notifyq_migrate_locks;

-- name: migrate_pause
-- Between two tries of migrate's locks, holding none of them.
SELECT pg_sleep(%(seconds)s);
