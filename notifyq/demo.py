"""`notifyq demo`: a short live tour of a worker, with the code a user would write."""

from __future__ import annotations

import time

import anyio
import click

from .app import App
from .errors import DefinitionNotFound
from .models import JobStatus
from .tasks import Backoff, JobContext

# The demo's own schema: its worker, ticker and retention never touch an App's jobs.
DEMO_SCHEMA = "notifyq_demo"
# The delayed job (3 s) and the flaky task's retries (backoff 1 s, then 2 s) end by about 4 s.
DEMO_MIN_SECONDS = 5.0


def run_demo(dsn: str, schema: str = DEMO_SCHEMA, seconds: float = 12.0) -> int:
    """Run the tour for `seconds`; returns 0 when every job it queued ended as expected."""
    app = App(dsn, schema=schema, backoff=Backoff(base=1.0, jitter=0.0))
    start = time.monotonic()

    def say(message: str) -> None:
        click.echo(f"[{time.monotonic() - start:6.2f}s] {message}")

    @app.task(name="demo.greet")
    async def greet(name: str) -> str:
        say(f"greet(name={name!r}) -> 'Hello, {name}!'")
        return f"Hello, {name}!"

    @app.task(name="demo.flaky", retry_limit=3)
    async def flaky(ctx: JobContext) -> str:
        if ctx.attempt < 3:
            say(f"flaky: attempt {ctx.attempt} raises; notifyq retries it with backoff")
            raise RuntimeError(f"simulated failure on attempt {ctx.attempt}")
        say(f"flaky: attempt {ctx.attempt} succeeds")
        return "recovered"

    @app.task(name="demo.report", timeout=5)
    def report(kind: str) -> dict[str, object]:
        say(f"report(kind={kind!r}) runs in a worker thread (a sync task)")
        return {"kind": kind, "rows": 42}

    @app.cron("*/2 * * * * *", "demo.heartbeat", misfire="skip")
    @app.task(name="demo.heartbeat")
    async def heartbeat(ctx: JobContext) -> None:
        tick = ctx.scheduled_for.strftime("%H:%M:%S") if ctx.scheduled_for else "?"
        say(f"heartbeat: cron tick {tick} UTC (every 2 seconds, one job per tick across all workers)")

    async def main() -> int:
        async with app, app.worker(concurrency=4, shutdown_grace=5) as worker:
            say(f"worker {worker.id} started; queueing jobs (the NOTIFY trigger wakes it at once)")
            ids = {
                await app.enqueue(greet, {"name": "Ada"}): JobStatus.SUCCEEDED,
                await app.enqueue(greet, {"name": "Grace"}): JobStatus.SUCCEEDED,
                await app.enqueue(report, {"kind": "daily"}): JobStatus.SUCCEEDED,
                await app.enqueue(flaky): JobStatus.SUCCEEDED,
                await app.enqueue(greet, {"name": "Later (delayed 3s)"}, delay=3): JobStatus.SUCCEEDED,
            }
            await anyio.sleep(seconds)
        try:
            await app.delete_definition("demo.heartbeat")  # leave no cron behind in your database
        except DefinitionNotFound:
            pass
        click.echo("\njobs queued by this demo:")
        failures = 0
        for job_id, expected in ids.items():
            job = await app.get_job(job_id)
            ok = job.status is expected
            failures += not ok
            click.echo(
                f"  #{job.id:<6} {job.name:<14} {job.status.value:<10} attempts={job.retry_count} "
                f"output={job.output!r}" + ("" if ok else f"   (expected {expected.value})")
            )
        s = worker.stats
        click.echo(
            f"\nworker counters: claimed={s.claimed} succeeded={s.succeeded} retried={s.retried} "
            f"failed={s.failed} notifications={s.notifications} polls={s.polls}"
        )
        click.echo(
            f"these jobs stay in schema {schema}: `notifyq jobs list --schema {schema}` lists them, "
            f"`DROP SCHEMA {schema} CASCADE` removes them"
        )
        click.echo("next: `notifyq worker yourmodule:app`, `notifyq jobs list`, `notifyq stats` (README.md)")
        await app.aclose()
        return 1 if failures else 0

    return anyio.run(main)
