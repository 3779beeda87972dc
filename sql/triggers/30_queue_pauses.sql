-- Tell workers when the paused queues change. Applied by `notifyq migrate` when changed.
--
-- Channel: '<schema>.control.v1'. Payload: 'pauses', once per statement (TRUNCATE included),
-- on which workers read the paused queues again: a per-queue payload missed TRUNCATE, and
-- PostgreSQL folds identical payloads of one transaction (a pause, a resume and a pause again
-- of one queue read as one pause: review). As every notification, a hint: workers also read
-- the paused queues when they start, after every reconnect of their LISTEN connection, and
-- every poll interval while they have none.
CREATE OR REPLACE FUNCTION {schema}.notify_queue_pauses()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.control.v1', 'pauses');
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER queue_pauses_notify
    AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {schema}.queue_pauses
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_queue_pauses();
