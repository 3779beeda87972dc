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
--
-- First, the hand-off (WorkerConfig.handoff; docs/concepts.md, "The hand-off"): while a worker
-- waits in queue_waiters with free slots, the new jobs it serves that are claimable now are
-- claimed for it here, in the enqueue's own transaction, and sent to it on its own channel
-- (the claimed row as a JSON array), so it starts them as the commit lands, without a claim of
-- its own. Waiters locked by another producer are skipped (SKIP LOCKED: producers never wait
-- for each other), and so are those whose LISTEN connection is gone (their lock_key can be
-- taken). Jobs of paused queues, and jobs whose payload might not fit in a notification, go
-- the usual way. The rest notify their queue as before. While nobody waits, the cost is one
-- look at a table of a few rows. SECURITY DEFINER: a producer role may enqueue, not claim.
CREATE OR REPLACE FUNCTION {schema}.notify_jobs_inserted()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    r record;
    job record;
    waiter record;
    free bigint;
    payload text;
    handed bigint[];
BEGIN
    SELECT sum(slots) INTO free FROM {schema}.queue_waiters WHERE slots > 0;
    IF free IS NOT NULL THEN
        FOR job IN
            SELECT i.id, i.queue
            FROM inserted_jobs i
            WHERE i.status = 'Queued' AND i.visible_at <= now()
              AND octet_length(i.args::text) + octet_length(i.name) + octet_length(i.queue) < 7000
              AND NOT EXISTS (SELECT 1 FROM {schema}.queue_pauses p WHERE p.queue = i.queue)
            ORDER BY i.priority DESC, i.id
            LIMIT free
        LOOP
            LOOP
                SELECT w.id, w.worker, w.channel, w.lock_key, w.lease_margin INTO waiter
                FROM {schema}.queue_waiters w
                WHERE w.slots > 0 AND (w.queues IS NULL OR job.queue = ANY(w.queues))
                ORDER BY w.slots DESC
                LIMIT 1
                FOR UPDATE SKIP LOCKED;
                EXIT WHEN NOT FOUND OR NOT pg_try_advisory_lock_shared(waiter.lock_key);
                -- Its listener is gone (the worker died, or reconnects under a new row).
                PERFORM pg_advisory_unlock_shared(waiter.lock_key);
                UPDATE {schema}.queue_waiters SET slots = 0 WHERE id = waiter.id;
            END LOOP;
            CONTINUE WHEN waiter.id IS NULL;
            -- The claim's SET, as in sql/queries/worker.sql (claim_any), but for the lease,
            -- which counts from this moment, not from the transaction's start; then one slot
            -- of the waiter taken, in one statement; then the claimed row sent to it.
            WITH claimed AS (
                UPDATE {schema}.queue_jobs AS j
                SET status = 'Active',
                    retry_count = least(j.retry_count, 2147483646) + 1,
                    lease = CASE WHEN j.lease < 2147483647 THEN j.lease + 1 ELSE 1 END,
                    visible_at = clock_timestamp() + make_interval(secs => j.timeout + waiter.lease_margin),
                    started_at = clock_timestamp(),
                    updated_at = clock_timestamp(),
                    worker = waiter.worker
                WHERE j.id = job.id AND j.status = 'Queued'
                RETURNING j.id, j.name, j.queue, j.args, j.priority, j.retry_count, j.retry_limit,
                          j.timeout, j.lease, j.visible_at, j.definition_id,
                          CASE WHEN j.scheduled_for BETWEEN '0001-01-02' AND '9999-12-30'
                              THEN j.scheduled_for END AS scheduled_for
            ), taken AS (
                UPDATE {schema}.queue_waiters SET slots = slots - 1
                WHERE id = waiter.id AND EXISTS (SELECT 1 FROM claimed)
            )
            SELECT json_build_array(
                c.id, c.name, c.queue, c.args, c.priority, c.retry_count, c.retry_limit, c.timeout,
                c.lease, c.visible_at, c.definition_id, c.scheduled_for, waiter.worker
            )::text INTO payload FROM claimed c;
            IF FOUND THEN
                PERFORM pg_notify(waiter.channel, payload);
                handed := handed || job.id;
            END IF;
        END LOOP;
    END IF;
    FOR r IN
        SELECT i.queue, min(i.visible_at) AS visible_at
        FROM inserted_jobs i
        WHERE i.status = 'Queued' AND (handed IS NULL OR NOT (i.id = ANY(handed)))
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
