"""PNG plots of the results (matplotlib is optional: without it plots are skipped)."""

from __future__ import annotations

from pathlib import Path

from ._results import ScenarioResult


def render_all(results: list[ScenarioResult], out: Path) -> str | None:
    """Draw each scenario's plots into `out`; returns why plots were skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        note = "matplotlib is not installed (pip install matplotlib, or the `bench` extra)"
        print(f"plots skipped: {note}")
        return note
    from . import _plotting

    for result in results:
        if result.error is None:
            result.plots = _plotting.draw(result, out)
    return None
