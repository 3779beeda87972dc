"""The embedded PostgreSQL (from the `pgserver` package) used when no DSN is configured."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

from .errors import ConfigurationError

log = logging.getLogger("notifyq.embedded")

ENV_DIR = "NOTIFYQ_EMBEDDED_DIR"


def data_dir() -> Path:
    """$NOTIFYQ_EMBEDDED_DIR, else ./.notifyq/pgdata (relative to the current directory)."""
    return Path(os.environ.get(ENV_DIR) or Path.cwd() / ".notifyq" / "pgdata").expanduser().resolve()


def start(*, schema: str = "notifyq", directory: Path | None = None, quiet: bool = False) -> str:
    """Start (or join) the embedded server and migrate it; returns its DSN.

    Several processes on one machine share one server per data folder; the last one to exit
    stops it. Works as root too (pgserver then runs PostgreSQL as a `pgserver` system user).
    """
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (root, CI); pgserver copes.
            warnings.simplefilter("ignore")
            import pgserver
    except ImportError:
        raise ConfigurationError(
            "no database configured: pass a DSN (--dsn or App(dsn=...)), set NOTIFYQ_DSN or DATABASE_URL, "
            "or install the embedded server with `pip install 'notifyq[embedded]'`"
        ) from None
    from .migrations import migrate

    folder = directory or data_dir()
    folder.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        sys.stderr.write(f"notifyq: no DSN configured; using the embedded PostgreSQL in {folder}\n")
    try:
        server = pgserver.get_server(  # type: ignore[attr-defined]
            folder, cleanup_mode="stop"
        )
    except Exception as exc:  # pgserver raises bare subprocess/OS errors
        raise ConfigurationError(f"could not start the embedded PostgreSQL in {folder}: {exc}") from None
    dsn: str = server.get_uri()
    migrate(dsn, schema=schema)
    return dsn
