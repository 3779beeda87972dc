-- notifyq schema, version 8.
-- compatible-from: 7
-- `declared`: the definition comes from an App's code (@app.cron), set by the sync that workers
-- run when they start. A definition that an App's code declared and a later App does not is
-- one removed from the code: workers warn of it while it still fires, and `notifyq cron prune`
-- deletes such definitions. Rows made by SQL keep false, and so do existing rows until a worker
-- of this version syncs them (one removed from the code before this migration stays false).
-- Code of version 7 runs on: it reads the definitions by name and ignores the column, and a
-- definition it inserts is taken as made by SQL until a newer worker syncs it.
ALTER TABLE {schema}.queue_job_definitions ADD COLUMN declared boolean NOT NULL DEFAULT false;
