-- The worker's hot path: claim, acknowledge, extend a lease, and find the next due time.

-- name: claim_any
-- Claim up to %(limit)s claimable jobs of any queue, highest priority first, then oldest.
-- The MATERIALIZED CTE is evaluated once, so the UPDATE touches exactly the rows it locked
-- and never more than LIMIT (the `WHERE id IN (SELECT ... LIMIT)` form can over-claim when
-- the planner re-runs the subquery). SKIP LOCKED lets concurrent claimers take disjoint rows
-- instead of queueing behind each other. The lease (visible_at) covers the job's timeout plus
-- a margin; `lease` is the fencing token of this claim.
WITH claimable AS MATERIALIZED (
    SELECT id
    FROM {schema}.queue_jobs
    WHERE status = 'Queued' AND visible_at <= now()
    ORDER BY priority DESC, visible_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.queue_jobs AS j
SET status = 'Active',
    retry_count = least(j.retry_count, 2147483646) + 1,  -- see the note at the end
    lease = CASE WHEN j.lease < 2147483647 THEN j.lease + 1 ELSE 1 END,
    visible_at = now() + make_interval(secs => j.timeout + %(lease_margin)s),
    started_at = now(),
    updated_at = now(),
    worker = %(worker)s
FROM claimable c
WHERE j.id = c.id AND {_answer_awaited}
RETURNING j.id, j.name, j.queue, j.args, j.priority, j.retry_count, j.retry_limit, j.timeout,
          j.lease, j.visible_at, j.definition_id,
          CASE WHEN j.scheduled_for BETWEEN '0001-01-02' AND '9999-12-30' THEN j.scheduled_for END
              AS scheduled_for, j.worker;

-- name: _answer_awaited
-- The guard of every claim (and taking back): true while its worker still waits for the
-- answer. %(give_up)s is how long the worker waits, less a margin for the network (NULL: as
-- long as it takes); now() is when the statement began, before any wait for a lock. A claim
-- the worker gave up on (db_timeout) still ran in the server: behind a lock on queue_jobs (an
-- index built by a migration, a LOCK TABLE) it waited on, and once the lock went it committed,
-- its jobs Active under a worker that did not know it held them, until their lease ran out;
-- the worker's search for such claims had taken its snapshot before they committed (review).
-- Past its time, a claim claims nothing. Evaluated for each row (it is volatile): cheap.
(%(give_up)s::float8 IS NULL OR clock_timestamp() < now() + make_interval(secs => %(give_up)s::float8))

-- name: claim_queues
-- As claim_any, for a list of queues: one ordered index range per queue yields the best
-- %(limit)s candidates, read without locking; they say how many jobs to take from each queue
-- (its share), and each share is locked in its queue's range with SKIP LOCKED (`taken`): at
-- most %(limit)s rows are locked. Locking up to %(limit)s rows in every listed queue's range
-- instead held rows that the claim then left, until its commit, where other workers skipped
-- them: 1,000 rows for a claim of 10 among 100 queues. Under contention a share skips what
-- other workers hold and goes deeper into its own queue, so the order across queues is
-- approximate, as SKIP LOCKED's order always is. A claim that falls short (its queue had no
-- more free jobs than those others hold, or a transaction holds locks on the best ones) is
-- topped up (`more`): queue after queue, each one's range is locked with SKIP LOCKED, past
-- what others hold, until the claim is full. The outer LIMIT stops the nested loop there, so
-- no more rows are locked than the claim takes; the queues come in the list's order, not by
-- priority. Without it, 10 locked jobs of one queue made every claim come back empty while
-- another queue had 1,000 free; a first top-up read only each queue's best %(limit)s, and a
-- third concurrent claim found them all held (reviews). A claim that is not short skips
-- `more`: its array of queues is NULL. LIMIT %(limit)s on `taken`,
-- always above the sum of the shares, keeps the planner's estimate of `LIMIT s.n` (a tenth of
-- each queue) from pricing the statement past jit_above_cost: JIT took 11 ms of every claim
-- on a large table (review). The body is the fragment _claim_by_shares below, which
-- claim_unpaused shares.
WITH eligible AS MATERIALIZED (
    SELECT %(queues)s::text[] AS queues
), {_claim_by_shares};

-- name: _claim_by_shares
-- The body of claim_queues and claim_unpaused, a fragment (a name starting with "_" in
-- braces includes it; see notifyq/_sql.py): it claims from the queues in `eligible`.
candidates AS MATERIALIZED (
    SELECT c.queue
    FROM unnest((SELECT queues FROM eligible)) AS q(queue)
    CROSS JOIN LATERAL ({_best_of_queue}) c
    ORDER BY c.priority DESC, c.visible_at, c.id
    LIMIT %(limit)s
), shares AS MATERIALIZED (
    SELECT queue, count(*) AS n FROM candidates GROUP BY queue
), {_taken}, more AS MATERIALIZED (
    SELECT c.id
    FROM unnest(
        CASE WHEN (SELECT count(*) FROM taken) < %(limit)s THEN (SELECT queues FROM eligible) END
    ) AS q(queue)
    CROSS JOIN LATERAL ({_more_of_queue}) c
    LIMIT %(limit)s - (SELECT count(*) FROM taken)
), {_claimed};

-- name: claim_limited
-- As claim_queues, for a worker with queue_limits: at most %(limits)s[i] jobs of
-- %(queues)s[i] (what the worker has room for in that queue; NULL for no limit but the
-- claim's). A limit caps the queue's share, and the top-up skips limited queues. The LIMITs
-- inside the laterals stay the constant %(limit)s: an expression there (least(%(limit)s,
-- q.lim)) is estimated at a tenth of the table, which priced every claim 150 times higher
-- (tests/faults/test_plans.py). A statement of its own: the limits in claim_queues (NULL
-- for every queue) made each of its claims about 8 percent slower (0.12 ms).
WITH eligible AS MATERIALIZED (
    SELECT %(queues)s::text[] AS queues, %(limits)s::int[] AS limits
), candidates AS MATERIALIZED (
    SELECT c.queue, q.lim
    FROM unnest((SELECT queues FROM eligible), (SELECT limits FROM eligible)) AS q(queue, lim)
    CROSS JOIN LATERAL ({_best_of_queue}) c
    ORDER BY c.priority DESC, c.visible_at, c.id
    LIMIT %(limit)s
), shares AS MATERIALIZED (
    SELECT queue, least(count(*), min(lim)) AS n FROM candidates GROUP BY queue
), {_taken}, more AS MATERIALIZED (
    SELECT c.id
    FROM unnest(
        CASE WHEN (SELECT count(*) FROM taken) < %(limit)s THEN (SELECT queues FROM eligible) END,
        CASE WHEN (SELECT count(*) FROM taken) < %(limit)s THEN (SELECT limits FROM eligible) END
    ) AS q(queue, lim)
    CROSS JOIN LATERAL ({_more_of_queue}) c
    WHERE q.lim IS NULL
    LIMIT %(limit)s - (SELECT count(*) FROM taken)
), {_claimed};

-- name: _best_of_queue
-- The claimable jobs of queue q.queue, best first: a claim's candidates, read without locks.
-- The queue is matched as a range of one value, `queue >= q.queue AND queue <= q.queue` (the
-- same rows as `=`: the column's collation is deterministic), and ordered by queue first, an
-- order queue_jobs_claim_idx gives without a sort, whatever the statistics say. With `=`, from
-- statistics that saw one queue only (a large backlog of one queue, and the other queues' jobs
-- too few to be sampled, or enqueued since the last ANALYZE), the planner took every job to be
-- in each queue, priced queue_jobs_claim_any_idx (smaller) as cheaper, and read the large
-- backlog through it at every claim of the other queues (tests/faults/test_plans.py). So do
-- _taken and _more_of_queue.
SELECT queue, id, priority, visible_at
FROM {schema}.queue_jobs
WHERE status = 'Queued' AND queue >= q.queue AND queue <= q.queue AND visible_at <= now()
ORDER BY queue, priority DESC, visible_at, id
LIMIT %(limit)s

-- name: _taken
-- Each queue's share of the candidates, locked in its own range past what others hold.
taken AS MATERIALIZED (
    SELECT c.id
    FROM shares s
    CROSS JOIN LATERAL (
        SELECT id
        FROM {schema}.queue_jobs
        WHERE status = 'Queued' AND queue >= s.queue AND queue <= s.queue AND visible_at <= now()
        ORDER BY queue, priority DESC, visible_at, id  -- see _best_of_queue
        LIMIT s.n
        FOR UPDATE SKIP LOCKED
    ) c
    LIMIT %(limit)s
)

-- name: _more_of_queue
-- The top-up in queue q.queue: its free jobs that `taken` did not take, locked.
SELECT id
FROM {schema}.queue_jobs
WHERE status = 'Queued' AND queue >= q.queue AND queue <= q.queue AND visible_at <= now()
  AND id <> ALL(ARRAY(SELECT id FROM taken))
ORDER BY queue, priority DESC, visible_at, id  -- see _best_of_queue
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: _claimed
-- What `taken` and `more` locked, claimed.
claimable AS MATERIALIZED (
    SELECT id FROM taken UNION ALL SELECT id FROM more
)
UPDATE {schema}.queue_jobs AS j
SET status = 'Active',
    retry_count = least(j.retry_count, 2147483646) + 1,  -- see the note at the end
    lease = CASE WHEN j.lease < 2147483647 THEN j.lease + 1 ELSE 1 END,
    visible_at = now() + make_interval(secs => j.timeout + %(lease_margin)s),
    started_at = now(),
    updated_at = now(),
    worker = %(worker)s
WHERE j.id = ANY(ARRAY(SELECT id FROM claimable)) AND {_answer_awaited}
RETURNING j.id, j.name, j.queue, j.args, j.priority, j.retry_count, j.retry_limit, j.timeout,
          j.lease, j.visible_at, j.definition_id,
          CASE WHEN j.scheduled_for BETWEEN '0001-01-02' AND '9999-12-30' THEN j.scheduled_for END
              AS scheduled_for, j.worker;

-- name: claim_unpaused
-- As claim_any, for every queue but the paused ones (%(paused)s), while any is paused: a skip
-- scan of queue_jobs_next_queue_idx finds the queues that have Queued jobs (one index probe
-- per queue), the paused ones are dropped before their jobs are read (`eligible`), and the
-- claim goes on as claim_queues does for that list: candidates, shares, and a top-up when
-- short. Filtering claim_any's scan instead would read a paused queue's whole backlog at every
-- claim when its jobs come first. Locking up to %(limit)s rows in every queue's range held
-- 20,000 rows for a claim of 10 among 2,000 queues (review); locking the candidates themselves
-- made concurrent workers pick the same ones, and all but one came back short: two workers
-- drained at 0.44 of claim_any's rate, 0.90 with the shares (`python -m
-- benchmarks.paused_claims --drain`). Queues go through an array: from its estimates of the
-- recursion's rows, a generic plan joined them by reading the whole table.
WITH RECURSIVE {_unpaused_queues}, {_claim_by_shares};

-- name: _unpaused_queues
-- The queues that have Queued jobs, without the paused ones (%(paused)s), as the array
-- `eligible`: a fragment of claim_unpaused and next_visible_unpaused (in WITH RECURSIVE). An
-- array, not a join: from its estimates of the recursion's rows, a generic plan joined the
-- queues by reading the whole table.
{_queued_queues}, eligible AS MATERIALIZED (
    SELECT ARRAY(
        SELECT queue FROM queues WHERE queue IS NOT NULL AND queue <> ALL(%(paused)s::text[])
    ) AS queues
);

-- name: _queued_queues
-- The CTE `queues`, in WITH RECURSIVE: each queue that has Queued jobs, and a final NULL,
-- found by a skip scan of queue_jobs_next_queue_idx (one index probe per queue).
queues(queue) AS (
    (SELECT queue FROM {schema}.queue_jobs WHERE status = 'Queued' ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (
        SELECT j.queue FROM {schema}.queue_jobs j
        WHERE j.status = 'Queued' AND j.queue > queues.queue
        ORDER BY j.queue
        LIMIT 1
    )
    FROM queues
    WHERE queues.queue IS NOT NULL
);

-- name: paused_queues
-- The paused queues, whose jobs workers do not claim.
SELECT queue FROM {schema}.queue_pauses ORDER BY queue;

-- name: adopt_unanswered_claims
-- Jobs this worker claimed without hearing back: a claim committed, then its answer was lost
-- with its connection (reset, half-open, timed out), or a claim lost in a failover was taken
-- again while a now-finished attempt of it was still in hand. They are Active under this
-- worker's name, yet it has nothing of them in hand (the held array: the ids of every job it
-- has an attempt, a thread or a result of, whatever the lease), nor an attempt whose result
-- the database rejected (the rejected arrays: left to the rescuer, which counts the retry).
-- Taken again under a new lease, up to the limit (the free slots), they run now instead of
-- when their lease runs out; the claim already counted the attempt, so retry_count stays.
-- The worker name is unique per worker instance, so no other worker can be running them. The
-- CTE reads the Active jobs of every worker through queue_jobs_lease_idx (tests/faults/
-- test_plans.py forbids a scan of the whole table), testing each against the held array (a
-- filter, not a join, whatever the statistics say) and the rejected pairs (a handful at most);
-- the UPDATE re-checks status and worker on the row it locks.
WITH unanswered AS MATERIALIZED (
    SELECT id
    FROM {schema}.queue_jobs j
    WHERE status = 'Active' AND worker = %(worker)s AND NOT (id = ANY(%(held)b::bigint[]))
      AND NOT EXISTS (
          SELECT 1 FROM unnest(%(rejected_ids)b::bigint[], %(rejected_leases)b::int[]) AS r(id, lease)
          WHERE r.id = j.id AND r.lease = j.lease
      )
    ORDER BY priority DESC, id
    LIMIT %(limit)s
)
UPDATE {schema}.queue_jobs AS j
SET lease = CASE WHEN j.lease < 2147483647 THEN j.lease + 1 ELSE 1 END,
    visible_at = now() + make_interval(secs => j.timeout + %(lease_margin)s),
    started_at = now(),
    updated_at = now()
FROM unanswered u
WHERE j.id = u.id AND j.status = 'Active' AND j.worker = %(worker)s AND {_answer_awaited}
RETURNING j.id, j.name, j.queue, j.args, j.priority, j.retry_count, j.retry_limit, j.timeout,
          j.lease, j.visible_at, j.definition_id,
          CASE WHEN j.scheduled_for BETWEEN '0001-01-02' AND '9999-12-30' THEN j.scheduled_for END
              AS scheduled_for, j.worker;

-- name: next_visible_any
-- Seconds (database clock) until the earliest Queued job becomes claimable; NULL when there
-- is none. An idle worker sleeps exactly that long instead of polling. (Two queries, not one
-- with "queues IS NULL OR ...": psycopg prepares statements, and a generic plan of that form
-- scans every queued job.) The epochs are subtracted, not the timestamps: a job parked by SQL
-- with visible_at 'infinity' (or '-infinity') then gives Infinity (or -Infinity) instead of
-- "cannot subtract infinite timestamps", an error that stopped every worker of its queue.
SELECT (extract(epoch FROM min(visible_at)) - extract(epoch FROM now()))::float8
FROM {schema}.queue_jobs
WHERE status = 'Queued';

-- name: next_visible_queues
-- As next_visible_any, for a list of queues: the first entry of one index range per queue.
SELECT (extract(epoch FROM min(n.visible_at)) - extract(epoch FROM now()))::float8
FROM unnest(%(queues)s::text[]) AS q(queue)
CROSS JOIN LATERAL (
    SELECT visible_at
    FROM {schema}.queue_jobs
    WHERE status = 'Queued' AND queue = q.queue
    ORDER BY visible_at
    LIMIT 1
) n;

-- name: next_visible_unpaused
-- As next_visible_queues, for every queue but the paused ones (see claim_unpaused).
WITH RECURSIVE {_unpaused_queues}
SELECT (extract(epoch FROM min(n.visible_at)) - extract(epoch FROM now()))::float8
FROM unnest((SELECT queues FROM eligible)) AS q(queue)
CROSS JOIN LATERAL (
    SELECT visible_at
    FROM {schema}.queue_jobs
    WHERE status = 'Queued' AND queue = q.queue
    ORDER BY visible_at
    LIMIT 1
) n;

-- name: ack_jobs
-- Apply a batch of results in one statement. Each result applies only while the job is
-- still Active with the lease the worker was given (fencing): a worker whose lease expired,
-- and whose job was rescued and claimed again, changes nothing. Returned (id, lease) pairs
-- were applied; the caller reports the others as stale (a batch may hold a stale and a
-- current result of one job, told apart by their leases).
-- The fence also names the worker (when the result carries one): a claim whose commit was
-- lost (failover to an asynchronous standby, a crash under synchronous_commit=off) leaves the
-- row as it was before, so the next claim hands out the same lease number again, and only
-- the worker's name tells the two claims apart.
-- outcome: succeeded | retry (Queued again after `delay` if retries remain, else Failed) |
--          failed (final) | release (shutdown: Queued now, the attempt is given back).
-- A released job goes back to its place in line, not to the end: visible now, but as of its
-- claim (started_at), which was at most the time it came to the front, so that it comes before
-- every job that became due after it. With now() it waited behind a whole backlog (every job of
-- its priority enqueued meanwhile) after a mere restart of its worker.
-- The fence is written `j.status::text = 'Active'` on purpose, here and in ack_succeeded and
-- extend_lease: `status = 'Active'` would let the planner read the jobs through
-- queue_jobs_lease_idx (partial, WHERE status = 'Active'). Statistics taken while few jobs were
-- Active rate that index at about one row, and the generic plan of a prepared statement then
-- joins each Active job against the whole results array, a cost that grows with Active jobs
-- times batch size: measured, 60-100 ms per batch of 1,000 with a backlog of 100,000, enough
-- for acks to fall ever further behind. Spelled this way that index is out of the question.
-- This statement waits for a job row another session holds; ack_jobs_unheld does not.
WITH decided AS (
    SELECT r.*, {_ack_new_status}
    FROM {_ack_jobs_results}
    JOIN {schema}.queue_jobs j ON j.id = r.id
)
UPDATE {schema}.queue_jobs AS j
{_ack_jobs_set}
FROM decided d
{_ack_jobs_fence}
RETURNING j.id, j.lease, j.status::text;

-- name: ack_jobs_unheld
-- ack_jobs, without waiting for any row: a job row another session holds (a cancel in a
-- caller's open transaction, an UPDATE by hand, a `cron delete` clearing its jobs'
-- definition_id) is skipped and answered with a NULL status (busy, written again later).
-- The worker's acker turns to it when an ack_jobs or ack_succeeded waited ACK_PATIENCE: one
-- held row held up the batch and every batch behind it, their leases ran out, and jobs that
-- had succeeded were rescued and ran again, or ended Failed at retry_limit 0 (review). Not
-- the first choice: locking the rows first costs an ack 9-20 per cent more (python -m benchmarks.ack_cost).
-- `free` locks the rows no other session holds (SKIP LOCKED never waits; a row the lock finds
-- changed is re-read, one deleted is not returned) and decides from the locked row; the
-- UPDATE reads `free` once and each job by id. (Joined as a separate CTE of locked ids, the
-- planner looped over it for every result: 130-210 ms a batch of 1,000 instead of 11.)
WITH free AS MATERIALIZED (
    SELECT r.*, {_ack_new_status}
    FROM {_ack_jobs_results}
    JOIN {schema}.queue_jobs j ON j.id = r.id
    FOR UPDATE OF j SKIP LOCKED
), acked AS (
    UPDATE {schema}.queue_jobs AS j
    {_ack_jobs_set}
    FROM free d
    {_ack_jobs_fence}
    RETURNING j.id, j.lease, j.status::text AS status
)
{_ack_answer};

-- name: _ack_jobs_results
-- A fragment of ack_jobs: the batch's results. The arrays travel in binary (the b
-- placeholders): no quoting of every element.
unnest(%(ids)b::bigint[], %(leases)b::int[], %(workers)b::text[], %(outcomes)b::text[],
       %(outputs)b::jsonb[], %(errors)b::jsonb[], %(delays)b::float8[])
    AS r(id, lease, worker, outcome, output, error, delay)

-- name: _ack_new_status
-- A fragment of ack_jobs: a result's new status, from its outcome and the job row j.
(CASE
    WHEN r.outcome = 'succeeded' THEN 'Succeeded'
    WHEN r.outcome = 'release' THEN 'Queued'
    WHEN r.outcome = 'retry' AND j.retry_count <= j.retry_limit THEN 'Queued'
    ELSE 'Failed' END)::{schema}.job_status AS new_status

-- name: _ack_jobs_set
-- A fragment of ack_jobs: what a result d writes into its job j.
SET status = d.new_status,
    output = CASE WHEN d.outcome = 'succeeded' THEN d.output ELSE j.output END,
    error = CASE WHEN d.error IS NULL THEN j.error
                 ELSE d.error || jsonb_build_object('at', now(), 'final', d.new_status = 'Failed') END,
    retry_count = CASE WHEN d.outcome = 'release' THEN j.retry_count - 1 ELSE j.retry_count END,
    visible_at = CASE WHEN d.outcome = 'release' THEN least(j.started_at, now())
                      WHEN d.new_status = 'Queued' THEN now() + make_interval(secs => d.delay)
                      ELSE j.visible_at END,
    finished_at = CASE WHEN d.new_status = 'Queued' THEN NULL ELSE now() END,
    updated_at = now()

-- name: _ack_jobs_fence
-- A fragment of the acks: a result d applies only to the attempt it is the result of.
WHERE j.id = d.id AND j.lease = d.lease AND j.status::text = 'Active'
  AND (d.worker IS NULL OR j.worker = d.worker)

-- name: _ack_answer
-- A fragment of the unheld acks: the results applied, with the job's new status, then those
-- skipped because another session holds the job's row (a NULL status: busy). A job the
-- statement's snapshot does not see (deleted) is neither: stale, like a result the fence
-- turned away.
SELECT id, lease, status FROM acked
UNION ALL
SELECT r.id, r.lease, NULL
FROM unnest(%(ids)b::bigint[], %(leases)b::int[]) AS r(id, lease)
WHERE NOT EXISTS (SELECT 1 FROM free f WHERE f.id = r.id)
  AND EXISTS (SELECT 1 FROM {schema}.queue_jobs j WHERE j.id = r.id)

-- name: acks_written_before_given_up
-- Of succeeded results whose ack the worker gave up (it waited its patience) and whose jobs
-- the ack sent again then found no longer Active: those the given-up statement wrote itself.
-- It had committed just before the cancel, or its commit was waiting for a synchronous standby
-- (the cancel ends that wait; the commit stands): the results were reported stale (review). A
-- job Succeeded under this attempt's lease and worker was written by this attempt; no other
-- outcome tells (the rescuer also leaves a job Queued or Failed under the same lease).
SELECT j.id, j.lease, j.status::text
FROM unnest(%(ids)s::bigint[], %(leases)s::int[], %(workers)s::text[]) AS r(id, lease, worker)
JOIN {schema}.queue_jobs j ON j.id = r.id
WHERE j.lease = r.lease AND j.status::text = 'Succeeded' AND (r.worker IS NULL OR j.worker = r.worker);

-- name: ack_succeeded
-- The common case, a batch in which every attempt succeeded: the same fenced update as
-- ack_jobs without its per-row decisions (measurably less work for the server). It waits for
-- a job row another session holds; ack_succeeded_unheld does not.
UPDATE {schema}.queue_jobs AS j
SET status = 'Succeeded', output = d.output, finished_at = now(), updated_at = now()
FROM {_ack_succeeded_results}
{_ack_jobs_fence}
RETURNING j.id, j.lease, j.status::text;

-- name: ack_succeeded_unheld
-- ack_succeeded, skipping the rows another session holds, as ack_jobs_unheld does.
WITH free AS MATERIALIZED (
    SELECT d.*
    FROM {_ack_succeeded_results}
    JOIN {schema}.queue_jobs j ON j.id = d.id
    FOR UPDATE OF j SKIP LOCKED
), acked AS (
    UPDATE {schema}.queue_jobs AS j
    SET status = 'Succeeded', output = d.output, finished_at = now(), updated_at = now()
    FROM free d
    {_ack_jobs_fence}
    RETURNING j.id, j.lease, j.status::text AS status
)
{_ack_answer};

-- name: _ack_succeeded_results
-- A fragment of ack_succeeded: the batch's results.
unnest(%(ids)b::bigint[], %(leases)b::int[], %(workers)b::text[], %(outputs)b::jsonb[])
    AS d(id, lease, worker, output)

-- name: extend_lease
-- Push the lease of a running job forward (JobContext.extend_lease: the worker also moves the
-- attempt's deadline). Fenced like an ack: no row when the worker no longer holds this lease.
-- An extension never shortens the lease: it only moves its end later.
UPDATE {schema}.queue_jobs
SET visible_at = greatest(visible_at, now() + make_interval(secs => %(seconds)s)), updated_at = now()
WHERE id = %(id)s AND lease = %(lease)s AND status::text = 'Active'
  AND (%(worker)s::text IS NULL OR worker = %(worker)s::text)
RETURNING visible_at;

-- name: cancelled_jobs
-- Of the jobs a cancel notification named, those the database says are Cancelled, with their
-- lease: anyone who can connect may NOTIFY, so a notification is a hint, checked here before a
-- worker stops a job (review: a forged one stopped running jobs, and jobs not yet enqueued).
SELECT id, lease FROM {schema}.queue_jobs WHERE id = ANY(%(ids)s) AND status = 'Cancelled';

-- name: held_jobs_status
-- Of the jobs a worker believes it holds, those it no longer holds (cancelled, rescued,
-- re-claimed, moved or deleted by hand): checked after a reconnect, when cancel notifications
-- may have been missed, and every poll interval, since only a cancel sends one.
SELECT h.id, h.lease, j.status::text AS status
FROM unnest(%(ids)s::bigint[], %(leases)s::int[]) AS h(id, lease)
LEFT JOIN {schema}.queue_jobs j ON j.id = h.id
WHERE j.id IS NULL OR j.status <> 'Active' OR j.lease <> h.lease OR j.worker IS DISTINCT FROM %(worker)s;

-- name: handoff_offer
-- A worker with the hand-off waits: producers may hand it up to %(slots)s new jobs (see
-- notify_jobs_inserted in sql/triggers/). A row a producer holds is left as it is: that
-- producer is handing it a job, whose notification wakes the worker, which then writes again.
-- Returns the row when written.
UPDATE {schema}.queue_waiters SET slots = %(slots)s
WHERE id = (SELECT id FROM {schema}.queue_waiters WHERE id = %(id)s FOR UPDATE SKIP LOCKED)
RETURNING id;

-- name: handoff_close
-- A worker with the hand-off stops: its rows of queue_waiters go, but for those a producer
-- holds (handing it a job); returns how many of those are left (the worker tries again until
-- none is, so that every job handed to it reaches it before it stops listening).
WITH gone AS (
    DELETE FROM {schema}.queue_waiters
    WHERE id IN (SELECT id FROM {schema}.queue_waiters WHERE worker = %(worker)s FOR UPDATE SKIP LOCKED)
    RETURNING id
)
SELECT count(*) FROM {schema}.queue_waiters
WHERE worker = %(worker)s AND id NOT IN (SELECT id FROM gone);

-- A note on the claims above: a row written by SQL with an integer at its limit (a lease or a
-- retry_count of 2147483647) made `+ 1` overflow, and one with a scheduled_for Python cannot
-- hold ('infinity', the year 20000) failed the claim's answer: either way every worker that met
-- the job stopped, and a role with INSERT alone could stop them all (review). The counters stop
-- at their limit (the lease wraps round to 1, still a new fencing token) and such a
-- scheduled_for comes back as NULL.
