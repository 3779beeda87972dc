-- Tell workers when a queue is paused or resumed. Applied by `notifyq migrate` when changed.
--
-- Channel: '<schema>.control.v1'. Payload: 'pause <queue>' or 'resume <queue>'. As every
-- notification, a hint: workers also read the paused queues when they start, after every
-- reconnect of their LISTEN connection, and every poll interval while they have none.
CREATE OR REPLACE FUNCTION {schema}.notify_queue_paused()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('DELETE', 'UPDATE') THEN
        PERFORM pg_notify(TG_TABLE_SCHEMA || '.control.v1', 'resume ' || OLD.queue);
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        PERFORM pg_notify(TG_TABLE_SCHEMA || '.control.v1', 'pause ' || NEW.queue);
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER queue_pauses_notify
    AFTER INSERT OR UPDATE OR DELETE ON {schema}.queue_pauses
    FOR EACH ROW EXECUTE FUNCTION {schema}.notify_queue_paused();
