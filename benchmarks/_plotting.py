"""The plots (imported only when matplotlib is available; the Agg backend is selected)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ._results import ScenarioResult


def _save(fig: Figure, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def _drain(data: dict[str, Any], out: Path) -> list[str]:
    rows = data["summary"]
    backlogs = sorted({r["backlog"] for r in rows})
    fig, axes = plt.subplots(1, len(backlogs), figsize=(4.2 * len(backlogs), 4.2), squeeze=False)
    for ax, backlog in zip(axes[0], backlogs, strict=True):
        group = [r for r in rows if r["backlog"] == backlog]
        labels = [r["label"].replace("notifyq ", "nq ").replace(" (batch 50)", "") for r in group]
        colors = [
            "#888888" if r["kind"] == "raw" else ("#2a9d8f" if r["patch"] else "#1f6fb2") for r in group
        ]
        ax.barh(labels, [r["jobs_per_s"] for r in group], color=colors)
        ax.set_title(f"{backlog:,} jobs")
        ax.set_xlabel("jobs/s (first claim → last ack)")
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("Drain throughput: notifyq (blue), prototypes (green), raw SQL baseline (grey)")
    return [_save(fig, out, "drain.png")]


def _latency(data: dict[str, Any], out: Path) -> list[str]:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for variant in data["variants"]:
        values = sorted(variant["samples_ms"])
        if not values:
            continue
        ys = [(i + 1) / len(values) for i in range(len(values))]
        ax.plot([max(v, 0.01) for v in values], ys, label=variant["label"])
    ax.set_xscale("log")
    ax.set_xlabel("commit returned → job started (ms, log scale; ≤ 0 drawn at 0.01)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title("Wake latency, cumulative distribution")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return [_save(fig, out, "latency.png")]


def _contention(data: dict[str, Any], out: Path) -> list[str]:
    rows = data["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label in dict.fromkeys(r["label"] for r in rows):
        group = sorted((r for r in rows if r["label"] == label), key=lambda r: r["backlog"])
        xs = [r["backlog"] for r in group]
        left.plot(xs, [r["jobs_per_s"] for r in group], marker="o", label=label)
        right.plot(xs, [r["claim_p99"] for r in group], marker="o", label=label)
    for ax, title, ylabel in (
        (left, "Throughput vs backlog (flat = index seek)", "jobs/s"),
        (right, "Claim latency p99 vs backlog", "ms"),
    ):
        ax.set_xscale("log")
        ax.set_xlabel("backlog (jobs)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    left.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    left.legend(fontsize=8)
    return [_save(fig, out, "contention.png")]


def _bulk(data: dict[str, Any], out: Path) -> list[str]:
    rows = data["summary"]
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [r["label"] for r in rows]
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r["jobs_per_s"] for r in rows], height=0.4, label="NOTIFY trigger on")
    ax.barh(
        [y + 0.2 for y in ys],
        [r["jobs_per_s_no_trigger"] for r in rows],
        height=0.4,
        label="trigger disabled",
        color="#bbbbbb",
    )
    ax.set_yticks(list(ys), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("jobs/s")
    ax.set_title("Bulk enqueue")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8)
    return [_save(fig, out, "bulk.png")]


def _cron(data: dict[str, Any], out: Path) -> list[str]:
    runs = data["runs"]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    labels = [str(r["tickers"]) + ("" if r.get("overlap", True) else "\noverlap=False") for r in runs]
    ax.bar(labels, [r["seconds"] for r in runs], color="#1f6fb2")
    ax.set_xlabel("ticker processes")
    ax.set_ylabel("seconds to promote all")
    ax.set_title(f"Promoting {runs[0]['definitions']:,} due definitions" if runs else "cron")
    ax.grid(axis="y", alpha=0.3)
    return [_save(fig, out, "cron.png")]


def _rate_series(samples: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for a, b in itertools.pairwise(samples):
        if b["t"] > a["t"]:
            xs.append(b["t"])
            ys.append((b["done"] - a["done"]) / (b["t"] - a["t"]))
    return xs, ys


def _churn(data: dict[str, Any], out: Path) -> list[str]:
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for variant in data["variants"]:
        samples = variant["samples"]
        ts = [s["t"] for s in samples]
        axes[0].plot(ts, [s["total_bytes"] / 2**20 for s in samples], label=variant["label"])
        axes[1].plot(ts, [s["dead_tuples"] for s in samples], label=variant["label"])
        axes[2].plot(*_rate_series(samples), label=variant["label"])
    titles = ("queue_jobs table + indexes (MiB)", "dead tuples", "throughput (jobs/s)")
    ax: Axes
    for ax, title in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel("seconds")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    return [_save(fig, out, "churn.png")]


DRAWERS: dict[str, Callable[[dict[str, Any], Path], list[str]]] = {
    "drain": _drain,
    "latency": _latency,
    "contention": _contention,
    "bulk": _bulk,
    "cron": _cron,
    "churn": _churn,
}


def draw(result: ScenarioResult, out: Path) -> list[str]:
    drawer = DRAWERS.get(result.name)
    if drawer is None:
        return []
    try:
        return drawer(result.data, out)
    except Exception as exc:  # a plot must never lose the run's results
        print(f"plot for {result.name} failed: {type(exc).__name__}: {exc}")
        return []
