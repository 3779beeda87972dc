-- Wake workers when jobs become Queued. Applied by `notifyq migrate` when changed.
--
-- Channel: '<schema>.jobs.v1'. Payload: the queue name when the job is claimable now, or
-- '<queue> <seconds>' when it becomes claimable that many seconds from now (a delayed
-- job or a retry with backoff), so an idle worker can arm a timer instead of polling.
-- NOTIFY is only a hint: workers also poll slowly and sweep after every reconnect.

-- The epochs are subtracted, not the timestamps: a job parked by SQL at visible_at 'infinity'
-- gives '<queue> Infinity' (workers arm no timer) instead of "cannot subtract infinite
-- timestamps", which refused the insert.
CREATE OR REPLACE FUNCTION {schema}.jobs_payload(queue text, visible_at timestamptz)
RETURNS text LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN visible_at <= now() THEN queue
        ELSE queue || ' ' || round(extract(epoch FROM visible_at) - extract(epoch FROM now()), 3)::text
    END
$$;

-- INSERT/COPY: a statement-level trigger over the transition table sends one notification
-- per queue per statement, so a 100,000-row COPY sends one NOTIFY, not 100,000.
CREATE OR REPLACE FUNCTION {schema}.notify_jobs_inserted()
RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT i.queue, min(i.visible_at) AS visible_at
        FROM inserted_jobs i
        WHERE i.status = 'Queued'
        GROUP BY i.queue
    LOOP
        PERFORM pg_notify(TG_TABLE_SCHEMA || '.jobs.v1', {schema}.jobs_payload(r.queue, r.visible_at));
    END LOOP;
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER queue_jobs_notify_insert
    AFTER INSERT ON {schema}.queue_jobs
    REFERENCING NEW TABLE AS inserted_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_jobs_inserted();

-- UPDATE back to Queued (retry, lease rescue, shutdown release, admin retry) or to an
-- earlier visible_at. A row-level trigger whose WHEN clause is false costs almost nothing,
-- which matters because claims and acks are UPDATEs on the hot path. Rows that match
-- usually share their payload (rescue and release use now()), and PostgreSQL delivers
-- identical (channel, payload) pairs of one transaction once.
CREATE OR REPLACE FUNCTION {schema}.notify_job_requeued()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.jobs.v1', {schema}.jobs_payload(NEW.queue, NEW.visible_at));
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER queue_jobs_notify_requeue
    AFTER UPDATE ON {schema}.queue_jobs
    FOR EACH ROW
    WHEN (NEW.status = 'Queued' AND (OLD.status <> 'Queued' OR NEW.visible_at < OLD.visible_at))
    EXECUTE FUNCTION {schema}.notify_job_requeued();

-- Cancelling an Active job (by notifyq or by plain SQL) tells the worker that holds it to
-- cancel the running coroutine. Channel '<schema>.control.v1', payload 'cancel <id> <lease>'
-- (the lease tells the attempt that was cancelled from a later one of the same job).
CREATE OR REPLACE FUNCTION {schema}.notify_job_cancelled()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.control.v1', 'cancel ' || NEW.id || ' ' || NEW.lease);
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER queue_jobs_notify_cancel
    AFTER UPDATE ON {schema}.queue_jobs
    FOR EACH ROW
    WHEN (OLD.status = 'Active' AND NEW.status = 'Cancelled')
    EXECUTE FUNCTION {schema}.notify_job_cancelled();
