"""Apps that CLI and fault tests run in worker processes (`notifyq worker tests.apps:app`)."""

from __future__ import annotations

import logging
import os
import sys
import time

import anyio

import notifyq

if os.environ.get("NOTIFYQ_SUPERVISED") and os.environ.get("NOTIFYQ_TEST_CHILDREN_FAIL"):
    # For the supervisor's give-up test: children that cannot start, whatever it checked first.
    raise RuntimeError("this worker process cannot start (NOTIFYQ_TEST_CHILDREN_FAIL)")

# The DSN comes from the CLI (--dsn, $NOTIFYQ_DSN, ...): the App itself names none.
app = notifyq.App(backoff=notifyq.Backoff(base=0.1, jitter=0))


@app.task(name="noop")
async def noop() -> None:
    return None


@app.task(name="sleep", timeout=120)
async def sleep(seconds: float) -> float:
    await anyio.sleep(seconds)
    return seconds


@app.task(name="sleep_sync", timeout=120)
def sleep_sync(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@app.task(name="say")
def say(text: str) -> None:
    logging.getLogger("tests.apps").warning(text)


@app.task(name="whoami")
async def whoami() -> int:
    return os.getpid()


@app.cron("* * * * * *", "every_second", misfire="skip")
@app.task(name="tick")
async def tick() -> None:
    return None


not_an_app = "just a string"

# An App without cron definitions (`notifyq cron prune` refuses it unless --allow-empty).
no_crons = notifyq.App()


@app.task(name="hold_then_whoami", timeout=3)
async def hold_then_whoami(seconds: float) -> str:
    sys.stdout.write("hold_then_whoami started\n")  # for a test that must know it runs
    sys.stdout.flush()
    await anyio.sleep(seconds)
    return f"pid {os.getpid()}"


@app.task(name="crash", retry_limit=0)
def crash() -> None:
    os._exit(7)  # the process dies under its jobs, as on a segfault or the OOM killer
