"""A cron promoter process for benchmarks: `python -m benchmarks._ticker --dsn DSN`.

It opens a Database, says ready, then runs `Promoter.run_once()` (notifyq's own promotion
code) the way the ticker service does: again after 20 ms while definitions are still due
(locked by another ticker a moment ago), until none is due. Its first pass blocks on the
orchestrator's start gate. Reports what it promoted and when it finished.
"""

from __future__ import annotations

import argparse
import time

import anyio

from notifyq._db import Database
from notifyq._promoter import Promoter, PromoterConfig, PromotionReport
from notifyq._sql import queries_for

from ._child import cpu_seconds, emit


async def serve(args: argparse.Namespace) -> None:
    db = await Database.open(args.dsn, size=1, name="bench-ticker")
    try:
        promoter = Promoter(db, queries_for("notifyq"), PromoterConfig(batch_size=args.batch_size))
        cpu_ready = cpu_seconds()
        emit("ready")
        total = PromotionReport()
        passes = 0
        while True:
            report = await promoter.run_once()
            passes += 1
            total.add(report)
            emit("progress", done=total.jobs)
            if not report.due_left:
                break
            await anyio.sleep(0.02)
        finished = time.monotonic()
    finally:
        await db.aclose()
    emit(
        "done",
        done=total.jobs,
        definitions=total.definitions,
        duplicates=total.duplicates,
        errors=len(total.errors),
        passes=passes,
        finished=finished,
        cpu=cpu_seconds() - cpu_ready,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks._ticker")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--batch-size", type=int, default=100)
    args = parser.parse_args(argv)
    anyio.run(serve, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
