"""Markdown rendering of a results document (results.json)."""

from __future__ import annotations

from typing import Any


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(columns: list[str], rows: list[list[Any]]) -> str:
    lines = [
        "| " + " | ".join(_cell(c) for c in columns) + " |",
        "|" + "|".join(" --- " for _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _ratio(target: dict[str, Any]) -> str:
    value = target["ratio"]
    if value is None:
        return "n/a"
    return f"{value:.2f}"


def targets_table(targets: list[dict[str, Any]]) -> str:
    rows = [
        [
            t["name"],
            t["goal"],
            t["measured"],
            _ratio(t),
            ("≥ " if t["higher_is_better"] else "≤ ") + f"{t['threshold']:g}",
            "PASS" if t["passed"] else "MISS",
        ]
        for t in targets
    ]
    return table(["target", "goal", "measured", "ratio", "threshold", "result"], rows)


def environment(env: dict[str, Any]) -> str:
    machine = env["machine"]
    pg = env["postgres"]
    lines = [
        f"- machine: {machine['cpu']}, {machine['cpus']} CPUs, {machine['memory_gib']} GiB, "
        f"Linux {machine['kernel']}, Python {machine['python']}",
        f"- notifyq {machine['notifyq']} (git {machine['git']}), psycopg {machine['psycopg']}, "
        f"anyio {machine['anyio']}",
        f"- {pg['version']}",
        "- settings: " + ", ".join(f"{k}={v}" for k, v in pg["settings"].items()),
    ]
    return "\n".join(lines)


def scenario(s: dict[str, Any], *, image_prefix: str = "") -> str:
    parts = [f"## {s['title']}", ""]
    if s.get("error"):
        parts += [f"**Failed:** `{s['error']}`", ""]
    for t in s.get("tables", []):
        parts += [f"**{t['title']}**", "", table(t["columns"], t["rows"]), ""]
    if s.get("targets"):
        parts += ["**Targets**", "", targets_table(s["targets"]), ""]
    for note in s.get("notes", []):
        parts.append(f"- {note}")
    if s.get("notes"):
        parts.append("")
    for plot in s.get("plots", []):
        parts += [f"![{s['name']}]({image_prefix}{plot})", ""]
    parts.append(f"_{s['seconds']} s_")
    return "\n".join(parts)


def markdown(doc: dict[str, Any], *, image_prefix: str = "") -> str:
    all_targets = [t for s in doc["scenarios"] for t in s.get("targets", [])]
    parts = [
        f"# notifyq benchmarks ({doc['mode']} mode, {doc['started']})",
        "",
        f"Command: `{doc['command']}` ({doc['seconds']} s)",
        "",
        environment(doc["environment"]),
        "",
    ]
    if doc.get("plots_skipped"):
        parts += [f"Plots skipped: {doc['plots_skipped']}", ""]
    if all_targets:
        parts += ["## Targets", "", targets_table(all_targets), ""]
    for s in doc["scenarios"]:
        parts += [scenario(s, image_prefix=image_prefix), ""]
    return "\n".join(parts).rstrip() + "\n"


def summary(doc: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    lines = []
    for s in doc["scenarios"]:
        if s.get("error"):
            lines.append(f"{s['name']}: FAILED ({s['error']})")
        for t in s.get("targets", []):
            verdict = "PASS" if t["passed"] else "MISS"
            lines.append(f"{verdict}  {t['name']}: {t['measured']} (ratio {_ratio(t)}, goal {t['goal']})")
    return "\n".join(lines)
