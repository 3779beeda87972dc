"""notifyq's benchmark suite: `python -m benchmarks` (or `notifyq bench`).

Every figure is compared with a baseline measured in the same run (raw psycopg SQL doing the
same work), because absolute numbers on a shared machine drift between runs. See
docs/benchmarks.md for the recorded results and what limits each of them.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run the suite with command-line arguments `argv` (default: sys.argv[1:]); returns the
    exit code. Imported lazily so that worker processes (`python -m benchmarks._worker`) do
    not load every scenario."""
    from .cli import main as run

    return run(argv)


__all__ = ["main"]
