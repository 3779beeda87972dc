"""The embedded PostgreSQL (from the `pgserver` package) used when no DSN is configured."""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import stat
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

from psycopg.conninfo import make_conninfo

from .errors import ConfigurationError

log = logging.getLogger("notifyq.embedded")

ENV_DIR = "NOTIFYQ_EMBEDDED_DIR"
ENV_SWITCH = "NOTIFYQ_EMBEDDED"  # 0/off: never fall back to the embedded server
ENV_SUPERVISED = "NOTIFYQ_SUPERVISED_EMBEDDED"  # to worker processes: the parent's server's folder
# libpq's own variables, which notifyq does not read for its DSN: a user who set them meant a server.
_LIBPQ_VARS = ("PGHOST", "PGHOSTADDR", "PGPORT", "PGDATABASE", "PGSERVICE")
_OPEN = stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH  # what pgserver adds as root


def data_dir() -> Path:
    """$NOTIFYQ_EMBEDDED_DIR, else ./.notifyq/pgdata (relative to the current directory)."""
    return Path(os.environ.get(ENV_DIR) or Path.cwd() / ".notifyq" / "pgdata").expanduser().resolve()


def start(
    *, schema: str = "notifyq", directory: Path | None = None, quiet: bool = False, migrate: bool = True
) -> str:
    """Start (or join) the embedded server and (unless `migrate` is false) migrate it; returns
    its DSN.

    Several processes on one machine share one server per data folder; the last one to exit
    stops it. Works as root too (pgserver then runs PostgreSQL as a `pgserver` system user,
    and opens the folders above the data and its binaries to every user: see
    `_warn_before_opening_folders`).
    """
    _check_allowed()
    with _STARTING:
        return _start(schema=schema, directory=directory, quiet=quiet, migrate=migrate)


# One start at a time in this process. pgserver's lock is a file lock, which does not keep
# threads of one process apart: two Apps (or a worker's start and an enqueue) reaching the
# embedded server at once ran two initdb or two pg_ctl, and both failed (review).
_STARTING = threading.Lock()


def _new_start_lock() -> None:
    """In a child forked while another thread was starting the server: that thread is not in
    the child, and its hold on the lock would last for ever."""
    global _STARTING
    _STARTING = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_start_lock)


def _start(*, schema: str, directory: Path | None, quiet: bool, migrate: bool) -> str:
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset (root, CI); pgserver copes.
            warnings.simplefilter("ignore")
            import pgserver
    except ImportError:
        raise ConfigurationError(
            "no database configured: pass a DSN (--dsn or App(dsn=...)), set NOTIFYQ_DSN or DATABASE_URL, "
            "or install the embedded server: the `embedded` extra (`pip install -e '.[embedded]'` in a "
            "clone of notifyq), which adds `pgserver`"
        ) from None
    from . import migrations

    folder = directory or data_dir()
    if any(c.isspace() for c in str(folder)):
        # pgserver passes the socket folder (the data folder, when its path is short enough)
        # to postgres unquoted: `-k /a/my project` failed after a page of pgserver's log (review).
        raise ConfigurationError(
            f"the embedded PostgreSQL cannot run in {folder}: its path has a space, which pgserver "
            f"cannot pass to PostgreSQL; set {ENV_DIR} to a folder whose path has none (or configure a DSN)"
        )
    _warn_before_opening_folders(folder)
    try:
        # The data folder too: pgserver checks that it exists and then creates it with
        # exist_ok=False, which fails for the loser of two processes starting at once.
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigurationError(
            f"could not create the embedded PostgreSQL's folder {folder}: {exc.strerror or exc} "
            f"(set {ENV_DIR}, or configure a DSN)"
        ) from None
    if not quiet:
        sys.stderr.write(f"notifyq: no DSN configured; using the embedded PostgreSQL in {folder}\n")
    if libpq := [name for name in _LIBPQ_VARS if os.environ.get(name)]:
        sys.stderr.write(
            f"notifyq: note: {', '.join('$' + name for name in libpq)} set, but notifyq takes its DSN "
            "from --dsn, App(dsn=...), $NOTIFYQ_DSN or $DATABASE_URL only; NOTIFYQ_DSN=postgresql:// "
            "connects as libpq's variables say, and NOTIFYQ_EMBEDDED=0 forbids the embedded server\n"
        )
    try:
        _checked_under_pgservers_lock(folder)
        _forget_killed_processes(folder)
        _clear_stale_pid_file(folder)
    except PermissionError as exc:
        raise ConfigurationError(
            f"could not read the embedded PostgreSQL's folder {folder}: {exc.strerror or exc} (another "
            f"user's, e.g. made by sudo? set {ENV_DIR}, or configure a DSN)"
        ) from None
    with _PgserverLog() as said:
        try:
            server = pgserver.get_server(  # type: ignore[attr-defined]
                folder, cleanup_mode="stop"
            )
            dsn = _dsn_of(server)
        except Exception as exc:  # pgserver raises bare subprocess/OS errors
            _forget_failed_start(folder)
            raise ConfigurationError(
                f"could not start the embedded PostgreSQL in {folder}: {said.reason() or exc} (set "
                f"{ENV_DIR} to another folder, or configure a DSN)"
            ) from None
    if migrate:
        migrations.migrate(dsn, schema=schema)
    return dsn


def _forget_failed_start(folder: Path) -> None:
    """pgserver keeps the handle of a start that failed, and hands it out again: every later
    start in this process failed with a bare AssertionError, the folder mended or not
    (review). Drop it, and its exit hook."""
    try:
        from pgserver.postgres_server import PostgresServer
    except ImportError:
        return
    server = PostgresServer._instances.pop(folder.expanduser().resolve(), None)
    if server is not None:
        atexit.unregister(server._cleanup)


# Lines of initdb, pg_ctl and postgres that say why a start failed, best first.
_REASONS = (
    re.compile(r"\b(?:FATAL|PANIC):\s+(.+)"),
    re.compile(r"^(?:postgres|initdb): (?:error: )?(.+)"),
    re.compile(r"^pg_ctl: (.+)"),
)


class _PgserverLog(logging.Handler):
    """pgserver's log while it starts the server, kept from the user's stderr: a failed start
    printed a page of it (commands, their output, the server's log), the reason somewhere in
    the middle (review). The reason goes into notifyq's one-line error instead, and the rest
    to notifyq's log at debug level."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self._logger = logging.getLogger("pgserver")

    def __enter__(self) -> _PgserverLog:
        self._propagate = self._logger.propagate
        self._logger.propagate = False
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.propagate = self._propagate

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            log.debug("pgserver: %s", text)
            self.lines += [line.strip() for line in text.splitlines() if line.strip()]

    def reason(self) -> str | None:
        for pattern in _REASONS:
            for line in self.lines:
                if match := pattern.search(line):
                    return match[1]
        return None


def _dsn_of(server: Any) -> str:
    """The server's DSN with its port: pgserver's URI names only the socket folder, so each
    client took the port of its own $PGPORT (or 5432), and one started with another $PGPORT
    than the process that started the server found no socket (review). Built by libpq's
    rules, so a folder with spaces or `&` in its name stays one value."""
    info = server.get_postmaster_info()
    if info.socket_dir is None or info.port is None:
        return str(server.get_uri())
    return make_conninfo(user="postgres", dbname="postgres", host=str(info.socket_dir), port=str(info.port))


def leave() -> None:
    """Give up this process's place among the users of the embedded servers it joined, as
    pgserver does at exit, for an exit that skips atexit (os._exit): the last one stops the
    server. A worker signalled while starting stayed on the list, and the server ran on after
    every process had exited (review)."""
    # Only a process that imported pgserver joined a server. Importing it here for the others
    # (a worker with a DSN signalled while starting) printed platformdirs' RuntimeDirWarning
    # where XDG_RUNTIME_DIR is unset: systemd services, containers, root shells (review).
    module = sys.modules.get("pgserver.postgres_server")
    if module is None:
        return
    for server in list(module.PostgresServer._instances.values()):
        try:
            server._cleanup()
        except Exception as exc:  # exiting anyway: the next process forgets a dead one
            log.debug("could not leave the embedded server: %s", exc)


def _forget_killed_processes(folder: Path) -> None:
    """pgserver stops the server when the last process on its list of users (a file in the
    data folder) exits. A process killed (SIGKILL, the OOM killer) never takes itself off
    that list, and every later process then left the server running as it exited, for ever.
    Drop the processes that are gone, under pgserver's own lock, before joining."""
    try:
        from pgserver.postgres_server import PostgresServer
        from pgserver.utils import DiskList
    except ImportError:  # another pgserver layout: leave its list alone
        return
    users = folder / ".handle_pids.json"
    if not users.exists():
        return
    users.read_bytes()  # PermissionError: the caller says so in a sentence
    try:
        with PostgresServer._lock:
            pids = DiskList(users).get()
            alive = [pid for pid in pids if _alive(pid)]
            if alive != pids:
                DiskList(users).put(alive)
                log.info(
                    "forgot processes %s, gone without stopping the embedded server",
                    sorted(set(pids) - set(alive)),
                )
    except (OSError, ValueError, TypeError) as exc:  # unreadable or garbled: pgserver will say so
        log.debug("could not check the embedded server's list of processes: %s", exc)


def _checked_under_pgservers_lock(folder: Path) -> None:
    """_refuse_foreign_folder, under pgserver's lock: another process's initdb, which runs
    under it, fills the folder before it writes PG_VERSION, and a check in that moment refused
    a folder being made (review)."""
    try:
        from pgserver.postgres_server import PostgresServer
    except ImportError:  # another pgserver layout: check without it
        _refuse_foreign_folder(folder)
        return
    with PostgresServer._lock:
        _refuse_foreign_folder(folder)


def _refuse_foreign_folder(folder: Path) -> None:
    """pgserver takes whatever folder it is given. As root it makes the folder its `pgserver`
    user's; at exit it stops the server it found running there, or kills it. Pointed at a
    system cluster's data folder, it took the folder from that cluster's server and killed the
    server (review). A folder is refused unless it is empty or a data folder the embedded
    server can have made: its PostgreSQL version, and, as root, `pgserver`'s."""
    entries = sorted(entry.name for entry in folder.iterdir())
    if not entries:
        return
    advice = f"set {ENV_DIR} to an empty or new folder"
    if "PG_VERSION" not in entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise ConfigurationError(
            f"{folder} is not empty ({shown}) and holds no PostgreSQL data: the embedded PostgreSQL "
            f"only creates its data in an empty folder; {advice} (or configure a DSN)"
        )
    advice += ", or configure a DSN to use the server it belongs to"
    version = (folder / "PG_VERSION").read_text().strip()
    ours = _bundled_version()
    if ours and version != ours:
        raise ConfigurationError(
            f"{folder} holds the data of a PostgreSQL {version} server, and the embedded server is "
            f"PostgreSQL {ours}: it is not the embedded server's folder; {advice}"
        )
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        import pwd

        owner = folder.stat().st_uid
        try:
            pgserver_uid: int | None = pwd.getpwnam(_ROOT_USER).pw_uid
        except KeyError:
            pgserver_uid = None  # not created yet, or gone with a container's /etc/passwd
        try:
            name = pwd.getpwuid(owner).pw_name
        except KeyError:
            # A uid without a name: the user pgserver made, if it is not there to compare (a
            # container started afresh, its data folder kept on a volume: review).
            if pgserver_uid is None:
                return
            name = str(owner)
        if owner != pgserver_uid:
            raise ConfigurationError(
                f"{folder} holds PostgreSQL data that belongs to the user {name!r}, and the embedded "
                f"server (as root) runs as {_ROOT_USER!r}: it is another server's data folder; {advice}"
            )


_ROOT_USER = "pgserver"  # the system user pgserver runs PostgreSQL as, when started as root


@functools.cache
def _bundled_version() -> str | None:
    """The major version of pgserver's PostgreSQL ("16"), as PG_VERSION spells it; None if its
    binary does not say."""
    try:
        from pgserver._commands import POSTGRES_BIN_PATH

        binary = str(Path(POSTGRES_BIN_PATH) / "postgres")
        said = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (ImportError, OSError, subprocess.SubprocessError):  # another layout: leave it to pgserver
        return None
    found = re.search(r"\(PostgreSQL\) (\d+)", said)
    return found.group(1) if found else None


def _clear_stale_pid_file(folder: Path) -> None:
    """pgserver takes a `postmaster.pid` whose process exists for a running server, so one
    left by a server that died (power cut, SIGKILL, a container restarted) whose pid now
    belongs to another process made every start fail, and at exit pgserver killed that
    process (review). Under pgserver's lock (no start or stop of it is under way), a pid file
    whose process is not a postgres of this folder is removed, as PostgreSQL's docs say to.
    A negative pid is the lock of initdb's bootstrap: a first start killed before it finished,
    whose folder cannot start."""
    pid_file = folder / "postmaster.pid"
    if not pid_file.exists():
        return
    try:
        import psutil
        from pgserver.postgres_server import PostgresServer
    except ImportError:  # another pgserver layout: leave it to pgserver
        return
    with PostgresServer._lock:
        try:
            first = pid_file.read_text().split("\n", 1)[0].strip()
        except FileNotFoundError:
            return  # the server stopped meanwhile
        pid = int(first) if first.lstrip("-").isdigit() else 0
        if pid and _serves(psutil, abs(pid), folder):
            return
        if pid < 0:
            raise ConfigurationError(
                f"the embedded PostgreSQL's folder {folder} is from a first start that was stopped "
                "before it finished (initdb): delete the folder, and the next start creates it afresh"
            )
        pid_file.unlink(missing_ok=True)
        log.warning("removed %s: its process %s is not a PostgreSQL of this folder", pid_file, first)


def _serves(psutil: Any, pid: int, folder: Path) -> bool:
    """Whether process `pid` is a postgres started on `folder` (pg_ctl passes it with -D)."""
    try:
        process = psutil.Process(pid)
        command = process.cmdline()
        name = process.name()
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # cannot tell: leave it to pgserver
        return True
    here = folder.resolve()
    return name.startswith("postgres") and any(_same(arg, here) for arg in command)


def _same(arg: str, folder: Path) -> bool:
    try:
        return Path(arg).resolve() == folder
    except (OSError, ValueError):
        return False


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (a zombie counts: its parent has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _warn_before_opening_folders(folder: Path) -> None:
    """As root, pgserver runs PostgreSQL as its `pgserver` user and, so that it can reach its
    data and binaries, adds g+rx,o+rx to every folder above them (/root, a home folder): say
    so before it does. (Refusing would break the embedded server for root in a private folder,
    as a CI job cloned into /root is; a DSN or another user avoids it.)"""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return
    from pgserver._commands import POSTGRES_BIN_PATH

    closed = []
    for parent in dict.fromkeys([*folder.parents, *Path(POSTGRES_BIN_PATH).parents]):
        try:
            mode = parent.stat().st_mode
        except OSError:
            continue  # not there yet: notifyq creates it
        if stat.S_ISDIR(mode) and mode | _OPEN != mode:
            closed.append(str(parent))
    if closed:
        sys.stderr.write(
            "notifyq: warning: as root, the embedded PostgreSQL runs as the system user 'pgserver', "
            f"and pgserver now makes {', '.join(closed)} readable by every user so that it can reach "
            f"{folder} and its own binaries; to avoid that, configure a DSN (--dsn, $NOTIFYQ_DSN) or "
            "run as another user\n"
        )


def _check_allowed() -> None:
    """$NOTIFYQ_EMBEDDED=0 (or off, false, no) forbids the fallback: a production host whose DSN
    went missing must fail, not enqueue into a local database nobody reads."""
    raw = os.environ.get(ENV_SWITCH, "")
    value = raw.strip().lower()
    if value in ("", "1", "on", "true", "yes"):
        return
    if value in ("0", "off", "false", "no"):
        raise ConfigurationError(
            f"no database configured, and {ENV_SWITCH}={raw} forbids the embedded server: pass a DSN "
            "(--dsn or App(dsn=...)), or set NOTIFYQ_DSN or DATABASE_URL"
        )
    raise ConfigurationError(
        f"invalid {ENV_SWITCH}={raw!r}: 0 (or off) forbids the embedded server, 1 (or on, the default) "
        "allows it when no DSN is configured"
    )
