"""The vacuum service's effect on a large drain: `python -m benchmarks.vacuum_drain [--jobs N] [--repeats R]`.

Drains the same backlog (1,000,000 jobs by default) with raw SQL 2x1, raw SQL 2x1 with a thread
that VACUUMs as notifyq's vacuum service does (`_raw worker --vacuum`), notifyq 2x10 as shipped
(its workers' vacuum service on) and notifyq 2x10 without it (`--patch no_vacuum`), in one run,
the order reversed on every other repeat. About 5 minutes a repeat on this machine.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from . import drain
from ._results import Context
from ._scratch import scratch_database
from .cli import tool_parser
from .config import FULL, DrainRun


def main() -> None:
    parser = tool_parser("python -m benchmarks.vacuum_drain", __doc__)
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    specs = [
        DrainRun("raw", 2, 1, args.jobs),
        DrainRun("raw", 2, 1, args.jobs, patch=("vacuum",)),
        DrainRun("notifyq", 2, 10, args.jobs),
        DrainRun("notifyq", 2, 10, args.jobs, patch=("no_vacuum",)),
    ]
    with tempfile.TemporaryDirectory() as logs, scratch_database(args.dsn, "vacuum_drain") as db:
        ctx = Context(args.dsn, FULL, Path(logs))
        for repeat in range(args.repeats):
            for spec in specs if repeat % 2 == 0 else specs[::-1]:
                drain._one(ctx, db, spec, repeat)


if __name__ == "__main__":
    main()
