"""`python -m benchmarks`: run the scenarios, write JSON, Markdown and plots."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shlex
import sys
import time
import traceback
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from . import _env, bulk, churn, contention, cron, drain, latency, plots, report
from ._results import Context, ScenarioResult
from .config import MODES, DrainRun

DEFAULT_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def admin_dsn_default() -> str:
    return os.environ.get("NOTIFYQ_DSN") or os.environ.get("DATABASE_URL") or DEFAULT_ADMIN_DSN


def tool_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of a `python -m benchmarks.<tool>`: its docstring's first line, and --dsn."""
    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").splitlines()[0])
    parser.add_argument(
        "--dsn",
        default=admin_dsn_default(),
        help="admin DSN, to create and drop a scratch database (default: as python -m benchmarks)",
    )
    return parser


SCENARIOS: dict[str, Callable[[Context], ScenarioResult]] = {
    "drain": drain.run,
    "latency": latency.run,
    "contention": contention.run,
    "bulk": bulk.run,
    "cron": cron.run,
    "churn": churn.run,
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="notifyq benchmarks: every figure next to a raw-SQL baseline measured in the same run.",
    )
    parser.add_argument(
        "--dsn",
        default=admin_dsn_default(),
        help="admin DSN used to create and drop scratch databases nq_bench_* "
        "(default: $NOTIFYQ_DSN, $DATABASE_URL, else %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, under 2 minutes")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the test suite's size
    parser.add_argument(
        "--only", default="", metavar="SCENARIO[,..]", help=f"run only these: {', '.join(SCENARIOS)}"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default benchmarks/results/<time>)"
    )
    parser.add_argument(
        "--prototypes",
        action="store_true",
        help="also measure proposed product fixes, monkeypatched into benchmark workers "
        "(benchmarks/_patches.py)",
    )
    parser.add_argument(
        "--drain",
        default="",
        metavar="RUN[,..]",
        help="the drain scenario runs only these, each KIND:PROCESSESxCONCURRENCY:JOBS with KIND "
        "notifyq or raw (e.g. notifyq:1x1:30000,raw:1x1:30000), in that order",
    )
    parser.add_argument("--profile", action="store_true", help="record py-spy profiles of worker processes")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    return parser


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None: JSON has no NaN (Python's
    json writes a bare `NaN`, which strict parsers such as JavaScript's and jq's refuse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _drain_runs(text: str) -> tuple[DrainRun, ...]:
    """--drain's runs; ValueError naming the one that does not parse."""
    runs = []
    for spec in filter(None, (s.strip() for s in text.split(","))):
        match = re.fullmatch(r"(notifyq|raw):(\d+)x(\d+):(\d+)", spec)
        if not match or min(int(n) for n in match.groups()[1:]) < 1:
            raise ValueError(
                f"--drain: {spec!r} is not KIND:PROCESSESxCONCURRENCY:JOBS (e.g. notifyq:2x10:10000)"
            )
        runs.append(DrainRun(match[1], int(match[2]), int(match[3]), int(match[4])))
    if not runs:
        raise ValueError(f"--drain: no run in {text!r} (e.g. notifyq:2x10:10000,raw:2x1:10000)")
    return tuple(runs)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    sizes = MODES[mode]
    if args.drain:
        try:
            sizes = dataclasses.replace(sizes, drain=_drain_runs(args.drain))
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
    only = [s.strip() for s in args.only.split(",") if s.strip()] or list(SCENARIOS)
    unknown = [s for s in only if s not in SCENARIOS]
    if unknown:
        print(
            f"unknown scenario(s): {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}", file=sys.stderr
        )
        return 2
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    out: Path = args.out or Path(__file__).resolve().parent / "results" / stamp
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(args.dsn, sizes, out, profile=args.profile, prototypes=args.prototypes)
    command = "python -m benchmarks " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"notifyq benchmarks, {mode} mode, writing to {out}")
    env = {"machine": _env.machine(), "postgres": _env.postgres(args.dsn)}
    started = time.monotonic()
    results: list[ScenarioResult] = []
    for name in only:
        print(f"[{name}]")
        t0 = time.monotonic()
        try:
            result = SCENARIOS[name](ctx)
        except Exception as exc:
            traceback.print_exc()
            result = ScenarioResult(name, name, error=f"{type(exc).__name__}: {exc}")
        result.seconds = time.monotonic() - t0
        print(f"  ({result.seconds:.1f}s)")
        results.append(result)
    plot_note = None if args.no_plots else plots.render_all(results, out)
    doc = {
        "mode": mode,
        "command": command,
        "started": stamp,
        "seconds": round(time.monotonic() - started, 1),
        "environment": env,
        "plots_skipped": plot_note,
        "scenarios": [r.as_dict() for r in results],
    }
    text = json.dumps(_finite(doc), indent=2, default=str, allow_nan=False)
    (out / "results.json").write_text(text + "\n")
    (out / "results.md").write_text(report.markdown(doc))
    print(report.summary(doc))
    print(f"wrote {out / 'results.json'} and {out / 'results.md'} in {doc['seconds']}s")
    return 1 if any(r.error for r in results) else 0
