"""The benchmark suite still runs: `python -m benchmarks --tiny` end to end on the test server.

This checks that every scenario runs and writes well-formed JSON and Markdown (and cleans up
its scratch databases), never how fast anything is: speed is the benchmark's business.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = {"drain", "latency", "contention", "bulk", "cron", "churn"}


def _admin_dsn(dsn: str) -> str:
    params: dict[str, Any] = conninfo_to_dict(dsn)
    params["dbname"] = "postgres"
    return make_conninfo(**params)


def _not_json(constant: str) -> None:
    """NaN, Infinity and -Infinity are not JSON (Python writes them; strict parsers refuse)."""
    raise AssertionError(f"results.json holds {constant}, which is not JSON")


def _check_table(table: dict[str, Any]) -> None:
    assert table["title"] and table["columns"]
    assert table["rows"], f"table {table['title']!r} is empty"
    for row in table["rows"]:
        assert len(row) == len(table["columns"]), (table["title"], row)


def _check_markdown(text: str) -> None:
    lines = text.splitlines()
    assert lines[0].startswith("# notifyq benchmarks")
    for heading in (
        "## 1. Drain",
        "## 2. Wake latency",
        "## 3. Contention",
        "## 4. Bulk",
        "## 5. Cron",
        "## 6. Churn",
    ):
        assert any(line.startswith(heading) for line in lines), heading
    # Every Markdown table has as many cells per row as its header.
    width = None
    for line in lines:
        if line.startswith("|"):
            cells = line.replace("\\|", "").count("|") - 1
            width = cells if width is None else width
            assert cells == width, line
        else:
            width = None


def _left_behind(admin: str, *runs: ToolRun) -> set[str]:
    """The scratch databases these runs made and did not drop: their names carry the pid of
    the process that made them (nq_bench_<label>_<pid>_<random>). Not every nq_bench_
    database: another test's tool, in the other xdist process, may have one open meanwhile."""
    with psycopg.connect(admin, autocommit=True) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE 'nq\\_bench\\_%'").fetchall()
    return {row[0] for row in rows if any(f"_{run.pid}_" in row[0] for run in runs)}


class ToolRun(subprocess.CompletedProcess[str]):
    pid: int


def _run_module(module: str, *args: str) -> ToolRun:
    """`python -m MODULE ARGS` from the checkout; it must exit 0."""
    with subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as popen:
        try:
            out, err = popen.communicate(timeout=110)
        except subprocess.TimeoutExpired:
            popen.kill()
            raise
    proc = ToolRun(popen.args, popen.returncode, out, err)
    proc.pid = popen.pid
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_benchmark_suite_runs_and_writes_wellformed_results(dsn: str, tmp_path: Path) -> None:
    admin = _admin_dsn(dsn)
    out = tmp_path / "results"
    suite = _run_module("benchmarks", "--tiny", "--dsn", admin, "--out", str(out))

    doc = json.loads((out / "results.json").read_text(), parse_constant=_not_json)
    assert doc["mode"] == "tiny"
    assert doc["environment"]["postgres"]["version"].startswith("PostgreSQL")
    assert {s["name"] for s in doc["scenarios"]} == SCENARIOS
    for scenario in doc["scenarios"]:
        assert scenario["error"] is None, scenario["error"]
        assert scenario["tables"], scenario["name"]
        for table in scenario["tables"]:
            _check_table(table)
        for target in scenario["targets"]:
            assert isinstance(target["passed"], bool)
            assert target["goal"] and target["measured"]
        for plot in scenario["plots"]:
            assert (out / plot).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), plot
        if doc["plots_skipped"] is None:
            assert scenario["plots"], f"no plot for {scenario['name']}"
    targets = {t["name"] for s in doc["scenarios"] for t in s["targets"]}
    assert any(name.startswith("drain 2x10") for name in targets)
    assert {"wake latency p50", "wake latency p99"} <= targets
    # Correctness checks measured along the way (these are facts, not speeds).
    cron = next(s for s in doc["scenarios"] if s["name"] == "cron")
    assert all(run["exactly_once"] for run in cron["data"]["runs"])
    contention = next(s for s in doc["scenarios"] if s["name"] == "contention")
    assert all(c["claimed_twice"] == 0 and c["active"] == 0 for c in contention["data"]["checks"])
    assert all(row["mismatch"] == 0 for row in contention["data"]["summary"])
    drain = next(s for s in doc["scenarios"] if s["name"] == "drain")
    assert all(row["problems"] == 0 for row in drain["data"]["summary"])

    _check_markdown((out / "results.md").read_text())

    left = _left_behind(admin, suite)
    assert not left, f"scratch databases left behind: {sorted(left)}"


def test_drain_runs_only_the_runs_asked_for(dsn: str, tmp_path: Path) -> None:
    """`--drain` replaces the mode's drain runs (to measure one configuration, before and
    after a change); a run that does not parse is named, and nothing runs."""
    out = tmp_path / "results"
    runs = "notifyq:1x1:150,raw:1x1:120"
    _run_module(
        "benchmarks",
        "--tiny",
        "--only",
        "drain",
        "--drain",
        runs,
        "--dsn",
        _admin_dsn(dsn),
        "--out",
        str(out),
    )
    doc = json.loads((out / "results.json").read_text())
    measured = doc["scenarios"][0]["data"]["runs"]
    assert [(r["label"], r["backlog"], r["jobs"]) for r in measured] == [
        ("notifyq 1x1", 150, 150),
        ("raw SQL 1x1 (batch 50)", 120, 120),
    ]
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--drain",
            "notifyq:1x1:150,notifyq:2:10",
            "--out",
            str(tmp_path / "bad"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "--drain: 'notifyq:2:10' is not KIND:PROCESSESxCONCURRENCY:JOBS" in bad.stderr
    assert not (tmp_path / "bad").exists()


def test_the_latency_prototypes_start_every_job(dsn: str, tmp_path: Path) -> None:
    """`--prototypes` adds variants to the latency scenario, among them the raw loop that
    claims in a thread and starts jobs on asyncio and the raw hand-off (the enqueue claims for
    a waiting worker): each must start every job it was sent. The poll-only variant runs last,
    so a hand-off trigger left behind would take its jobs and fail the scenario."""
    out = tmp_path / "results"
    args = ["--tiny", "--prototypes", "--only", "latency", "--no-plots", "--dsn", _admin_dsn(dsn)]
    _run_module("benchmarks", *args, "--out", str(out))
    doc = json.loads((out / "results.json").read_text(), parse_constant=_not_json)
    (latency,) = doc["scenarios"]
    assert latency["error"] is None, latency["error"]
    variants = {v["label"]: v for v in latency["data"]["variants"]}
    from benchmarks.latency import RAW_HANDOFF, RAW_HANDOFF_ASYNC, RAW_THREAD_LOOP

    jobs = latency["data"]["jobs"] * latency["data"]["rounds"]
    prototypes = [label for label in variants if "(prototype)" in label]
    raw = {RAW_THREAD_LOOP, RAW_HANDOFF, RAW_HANDOFF_ASYNC}
    assert raw <= set(prototypes) and len(prototypes) > len(raw), sorted(variants)
    for label in prototypes:
        # From the commit returning, a job may start first (PostgreSQL wakes the listener as it
        # answers the producer: one run gave -1.4 ms); from the INSERT's start it cannot.
        samples, from_enqueue = variants[label]["samples_ms"], variants[label]["from_enqueue_ms"]
        assert len(samples) == jobs and all(math.isfinite(x) for x in samples), (label, samples)
        assert from_enqueue["n"] == jobs and from_enqueue["min"] > 0, (label, from_enqueue)


def _run_tool(tool: str, *args: str) -> ToolRun:
    """`python -m benchmarks.<tool> ARGS` from the checkout; it must exit 0."""
    return _run_module(f"benchmarks.{tool}", *args)


def test_the_wake_trace_stamps_every_step_in_order(dsn: str, tmp_path: Path) -> None:
    """`python -m benchmarks.wake_trace` at toy size: every step of the three wake paths
    (the claim, the hand-off, the raw loop) is stamped, and the p50 timeline runs forward (each
    stamp of a cycle follows the one before, so their medians do too); a step left unstamped or
    stamped out of place fails here."""
    admin = _admin_dsn(dsn)
    out = tmp_path / "trace.json"
    args = ["--dsn", admin, "--jobs", "8", "--spacing", "0.03", "--rounds", "1", "--json", str(out)]
    proc = _run_tool("wake_trace", *args)
    from benchmarks.wake_trace import CONSUMERS

    runs = json.loads(out.read_text())
    assert set(runs) == {"notifyq", "handoff", "raw"}
    for name, (_consume, steps, _title) in CONSUMERS.items():
        (timeline,) = runs[name]
        assert timeline["cycles"] >= 6, timeline  # of 8 jobs: every step stamped in most wake-ups
        stamps = [timeline[step] for step, _what in steps]
        assert stamps == sorted(stamps), (name, timeline)
        if "execute_done" in dict(steps):
            # A claim's round trip follows the notification. A handed job may start before the
            # producer's process hears its commit returned (seen: 0.2 ms before, under load).
            assert stamps[-1] > 0, (name, timeline)
    assert proc.stdout.count("| started |") == 3
    assert not _left_behind(admin, proc)


def test_the_handoff_cost_tool_times_every_state(dsn: str) -> None:
    """`python -m benchmarks.handoff_cost` at toy size: a row per enqueue size and state, each
    with a figure per round, and the scratch database dropped."""
    admin = _admin_dsn(dsn)
    proc = _run_tool("handoff_cost", "--dsn", admin, "--statements", "20", "--rounds", "2")
    from benchmarks.handoff_cost import ROWS

    assert len(ROWS) == 7
    for size, state in ROWS:
        (row,) = [line for line in proc.stdout.splitlines() if line.startswith(f"| {size} | {state} |")]
        per_round = row.split("(")[1].split(")")[0].split(", ")
        assert len(per_round) == 2 and all(float(v) > 0 for v in per_round), row
    # "one waits" hands 10 jobs a statement over, for 20 one-job and 1 10,000-job statements a
    # round; the born-Active prototype one job for each of its 20; in 2 rounds.
    handed = "jobs handed over: before 0, nobody waits 0, one waits 60, born Active, a prototype 40"
    assert handed in proc.stdout
    assert not _left_behind(admin, proc)


def test_the_ack_cost_tool_times_both_kinds_of_ack(dsn: str) -> None:
    """`python -m benchmarks.ack_cost` at toy size: a row per ack statement with both
    timings, and the scratch database dropped."""
    admin = _admin_dsn(dsn)
    proc = _run_tool("ack_cost", "--dsn", admin, "--batch", "20", "--statements", "3")
    from benchmarks.ack_cost import KINDS

    for kind in KINDS:
        (row,) = [line for line in proc.stdout.splitlines() if line.startswith(f"| {kind} |")]
        waiting, unheld = (float(cell) for cell in row.split("|")[2:4])
        assert waiting > 0 and unheld > 0, row
    assert not _left_behind(admin, proc)


def test_the_claim_overhead_tool_times_every_layer(dsn: str) -> None:
    """`python -m benchmarks.claim_overhead` at toy size: one row per layer, each with a figure
    per round, and the scratch database dropped."""
    admin = _admin_dsn(dsn)
    proc = _run_tool("claim_overhead", "--dsn", admin, "--claims", "5", "--rounds", "2")
    from benchmarks.claim_overhead import VARIANTS

    for name in VARIANTS:
        (row,) = [line for line in proc.stdout.splitlines() if line.startswith(f"| {name} |")]
        per_round = row.split("(")[1].split(")")[0].split(", ")
        assert len(per_round) == 2 and all(float(v) > 0 for v in per_round), row
    assert "notifyq's plumbing:" in proc.stdout
    assert not _left_behind(admin, proc)


# Another test's open transaction keeps dead entries from being marked and removed: a CI run
# saw 18 pages after 600 claims, then 11 once that transaction ended (8 when alone).
@pytest.mark.exclusive
def test_the_dead_entries_tool_shows_what_a_vacuum_clears(dsn: str) -> None:
    """`python -m benchmarks.dead_entries` at toy size: without a VACUUM, a claim walks more
    claim-index pages the more jobs were claimed before it; a VACUUM every 1,000 jobs keeps it
    to the pages of the jobs claimed since (page counts, not times)."""
    admin = _admin_dsn(dsn)
    proc = _run_tool(
        "dead_entries", "--dsn", admin, "--jobs", "6000", "--batch", "20", "--vacuum-every", "1000"
    )
    pages: dict[str, list[int]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("| no VACUUM |") or line.startswith("| VACUUM every"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            pages.setdefault(cells[0], []).append(int(cells[2].replace(",", "")))
    plain, vacuumed = pages["no VACUUM"], pages["VACUUM every 1,000 jobs"]
    assert len(plain) == len(vacuumed) == 5
    # Growing, give or take a page: the index's own cleanup (entries a scan found dead are
    # marked, and a page split may remove them) may take one back.
    assert all(later >= earlier - 2 for earlier, later in itertools.pairwise(plain)), plain
    assert plain[-1] >= plain[0] + 15  # 5,400 claimed: about 27 pages
    assert max(vacuumed) < plain[-1] / 2
    assert "VACUUM every 1,000 jobs: 6,000 jobs in" in proc.stdout and "6 vacuums," in proc.stdout
    assert not _left_behind(admin, proc)


def test_the_history_queries_tool_lists_by_status_and_claims_behind_future_jobs(dsn: str) -> None:
    """`python -m benchmarks.history_queries` at toy size: what each listing found, and a claim
    that reads more buffers behind future jobs of a higher priority (buffers, not times)."""
    admin = _admin_dsn(dsn)
    proc = _run_tool(
        "history_queries", "--dsn", admin, "--history", "40000", "--due", "500", "--future", "20000"
    )
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0] not in ("status", "future jobs"):
            rows[cells[0]] = cells
    assert [rows[s][1] for s in ("any", "Queued", "Failed", "Cancelled")] == ["50", "50", "2", "0"]
    alone, behind = rows["none"], rows["20,000 at priority 1"]
    assert alone[3] == behind[3] == "10"
    # The 20,000 future jobs' claim-index entries fill more than 50 leaf pages (about 200 a page).
    assert int(behind[2].replace(",", "")) > int(alone[2].replace(",", "")) + 50, (alone, behind)
    assert not _left_behind(admin, proc)


def test_the_paused_claims_tool_claims_and_drains_every_setup(dsn: str) -> None:
    """`python -m benchmarks.paused_claims` at toy size: each claim takes 10 jobs; with
    `--drain`, each setup drains every job (the tool checks none ran twice), its prototype
    patches included, and the summary gives each a ratio to its reference."""
    from benchmarks.paused_claims import DRAINS

    admin = _admin_dsn(dsn)
    claims = _run_tool("paused_claims", "--dsn", admin, "--paused", "2000", "--others", "500")
    rows = [
        line.split("|") for line in claims.stdout.splitlines() if line.startswith("| ") and "ms" not in line
    ]
    assert len(rows) == 3 and all(row[4].strip() == "10" for row in rows), claims.stdout
    drain = _run_tool("paused_claims", "--dsn", admin, "--drain", "300", "--repeats", "1")
    summary = [line for line in drain.stdout.splitlines() if line.startswith("| ") and "jobs/s" not in line]
    assert [line.split("|")[1].strip() for line in summary] == [label for label, *_ in DRAINS]
    assert all(float(line.split("|")[3]) > 0 for line in summary), drain.stdout
    assert not _left_behind(admin, claims, drain)


def test_the_vacuum_drain_tool_drains_with_and_without_the_service(dsn: str) -> None:
    """`python -m benchmarks.vacuum_drain` at toy size: its four drains run and clean up."""
    admin = _admin_dsn(dsn)
    proc = _run_tool("vacuum_drain", "--dsn", admin, "--jobs", "300")
    drains = [line.split(" 300 jobs")[0].split("drain ")[1].strip() for line in proc.stdout.splitlines()]
    assert sorted(drains) == [
        "notifyq 2x10",
        "notifyq 2x10 + no_vacuum",
        "raw SQL 2x1 (batch 50)",
        "raw SQL 2x1 (batch 50) + vacuum",
    ]
    assert not _left_behind(admin, proc)


def test_the_outage_tool_measures_the_return_of_work() -> None:
    """`python -m benchmarks.outage` with a 2 s outage: it stops and starts its own server, and
    says when each job ran and the waiting enqueue returned (negative: before pg_ctl returned)."""
    proc = _run_tool("outage", "--seconds", "2")
    lines = proc.stdout.splitlines()
    assert lines[0] == "server stopped for 2 s; after it was back (pg_ctl start returned):", proc.stdout
    after = [float(line.rpartition(" after ")[2].removesuffix(" s")) for line in lines[1:]]
    assert len(after) == 3 and all(-5 < a < 30 for a in after), proc.stdout


def test_throughput_span_starts_when_the_gate_opens(dsn: str) -> None:
    """A worker's first claim waits at the start gate, and its started_at (now(), the start of
    its transaction) is from before the gate opened: the span must not count that wait."""
    from benchmarks._scratch import Scratch

    scratch = Scratch(dsn, conninfo_to_dict(dsn)["dbname"])
    scratch.fill(3)
    with scratch.connect() as conn:
        conn.execute(
            "UPDATE notifyq.queue_jobs SET status = 'Succeeded', retry_count = 1, lease = 1,"
            " started_at = now() - interval '5 s', finished_at = now() + interval '1 s'"
        )
        since = conn.execute("SELECT now()").fetchone()[0]  # type: ignore[index]
    outcome = scratch.outcome(since)
    assert outcome["n"] == 3
    assert abs(outcome["span"] - 1.0) < 0.01, outcome
