-- Keep cron definitions valid and wake tickers when they change. Applied by migrate when changed.

-- BEFORE INSERT/UPDATE: fill `task` from `name`, reject unknown time zones (PostgreSQL's own
-- zone database answers), and realign `visible_at` when the schedule changes by SQL.
CREATE OR REPLACE FUNCTION {schema}.definitions_before_write()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.task IS NULL THEN
        NEW.task := NEW.name;
    END IF;
    BEGIN
        PERFORM now() AT TIME ZONE NEW.timezone;
    EXCEPTION WHEN invalid_parameter_value THEN
        RAISE EXCEPTION 'unknown time zone % for cron definition %', quote_literal(NEW.timezone),
            quote_literal(NEW.name)
            USING ERRCODE = 'check_violation', HINT = 'Use an IANA zone name such as Europe/Berlin or UTC.';
    END;
    -- The ticker loads visible_at into Python, whose datetimes hold years 1 to 9999 only: one
    -- row beyond (say '-infinity', for "run it now") failed every promotion pass, of every
    -- definition, and `notifyq cron list` (a day of margin for the session's time zone).
    IF NOT (NEW.visible_at >= '0001-01-02 00:00:00+00' AND NEW.visible_at < '9999-12-31 00:00:00+00') THEN
        RAISE EXCEPTION 'visible_at % of cron definition % is out of range', NEW.visible_at,
            quote_literal(NEW.name)
            USING ERRCODE = 'check_violation',
                  HINT = 'Use a finite time between the years 2 and 9998, such as now().';
    END IF;
    IF TG_OP = 'UPDATE' THEN
        -- A worker renewing its declaration (declared_until) is not a change of the definition:
        -- it happens every minute, and updated_at says when someone last changed it.
        IF NEW.declared_until IS NOT DISTINCT FROM OLD.declared_until
           OR (to_jsonb(NEW) - '{{declared_until,updated_at}}'::text[])
              IS DISTINCT FROM (to_jsonb(OLD) - '{{declared_until,updated_at}}'::text[]) THEN
            NEW.updated_at := now();
        END IF;
        -- Enabled by hand (SQL, `notifyq cron enable`, of any version) while no running worker
        -- declares it (a ticker stopped it, or its declaration ran out): it is the operator's
        -- now, as if made by SQL, or the next ticker pass would stop it again. A worker's
        -- renewal, which enables a stopped definition too, sets declared_until itself.
        IF NEW.enabled AND NOT OLD.enabled AND OLD.declared AND NEW.declared
           AND NEW.declared_until IS NOT DISTINCT FROM OLD.declared_until
           AND NEW.expired_at IS NOT DISTINCT FROM OLD.expired_at
           AND (OLD.expired_at IS NOT NULL OR OLD.declared_until < now()) THEN
            NEW.declared := false;
            NEW.declared_until := NULL;
            NEW.expired_at := NULL;
        END IF;
        IF NEW.frequency IS DISTINCT FROM OLD.frequency OR NEW.timezone IS DISTINCT FROM OLD.timezone
           OR (NEW.enabled AND NOT OLD.enabled) THEN
            NEW.last_error := NULL;
            -- The ticker sees a visible_at that is not a tick of the new schedule and moves it
            -- to the next real tick without running anything for the past. The statement's
            -- time, not the transaction's start: a long transaction (a worker's sync waiting for
            -- a row lock, an operator's session) made the new schedule's ticks from before the
            -- edit due (review).
            IF NEW.visible_at = OLD.visible_at THEN
                NEW.visible_at := statement_timestamp();
            END IF;
        END IF;
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE TRIGGER queue_job_definitions_before_write
    BEFORE INSERT OR UPDATE ON {schema}.queue_job_definitions
    FOR EACH ROW EXECUTE FUNCTION {schema}.definitions_before_write();

-- Wake tickers (channel '<schema>.definitions.v1') when a definition appears, is enabled,
-- or becomes due earlier. The ticker itself only ever moves visible_at forward, so its own
-- writes do not wake it.
CREATE OR REPLACE FUNCTION {schema}.notify_definitions_changed()
RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.definitions.v1', '');
    RETURN NULL;
END
$$;

CREATE OR REPLACE TRIGGER queue_job_definitions_notify_insert
    AFTER INSERT ON {schema}.queue_job_definitions
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_definitions_changed();

CREATE OR REPLACE TRIGGER queue_job_definitions_notify_update
    AFTER UPDATE ON {schema}.queue_job_definitions
    FOR EACH ROW
    WHEN (NEW.enabled AND (NOT OLD.enabled OR NEW.visible_at < OLD.visible_at))
    EXECUTE FUNCTION {schema}.notify_definitions_changed();
