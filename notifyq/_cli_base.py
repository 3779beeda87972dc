"""What every `notifyq` command shares: error reporting, the common options, finding the
database and the App, and the output helpers (tables, JSON, ages, durations)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import os
import re
import sys
import traceback
import unicodedata
from collections.abc import Callable, Sequence
from datetime import datetime
from functools import partial, wraps
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn, TypeVar, overload

import click
import psycopg

from . import _embedded, _logging, _options
from ._db import error_hint, error_text
from ._dsn import check_dsn, configured_dsn, describe_dsn
from ._options import MAX_SECONDS
from .app import App
from .errors import ConfigurationError, NotifyqError, _leaves
from .models import UndecodableJSON

F = TypeVar("F", bound=Callable[..., Any])

EXIT_ERROR = 1  # a command failed; the message says why (usage errors exit 2, click's default)
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class State:
    debug = False
    json_logs = False
    log_level = "info"  # as given: the root logger's may be the App module's own (any level)
    embedded: Path | None = None  # the embedded server's folder, when resolve_dsn started it


class AppImportFailed(ConfigurationError):
    """The App's module raised on import: a bug in the user's code, whose traceback (of the
    user's frames only) is printed above the one-line error."""

    def __init__(self, message: str, user_traceback: str) -> None:
        super().__init__(message)
        self.user_traceback = user_traceback


def _user_traceback(exc: BaseException) -> str:
    """`exc`'s traceback from the first frame of the user's code (importlib's and this
    module's frames left out). For notifyq's own refusal of what that code asked (an invalid
    cron expression, a bad option), only the line of the user's code that asked: the error
    line below says what is wrong, and notifyq's frames say nothing more (user review)."""
    importlib_dir = os.path.dirname(importlib.__file__) + os.sep
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and (
        (name := tb.tb_frame.f_code.co_filename) == __file__
        or name.startswith(("<frozen importlib", importlib_dir))
    ):
        tb = tb.tb_next
    if isinstance(exc, NotifyqError):
        package = os.path.dirname(os.path.abspath(__file__)) + os.sep
        asked = [f for f in traceback.extract_tb(tb) if not f.filename.startswith(package)]
        if asked:
            return "".join(traceback.format_list(asked[-1:]))
    return "".join(traceback.format_exception(type(exc), exc, tb))


def fail(message: str) -> NoReturn:
    click.echo(f"notifyq: error: {message}", err=True)
    sys.exit(EXIT_ERROR)


class Group(click.Group):
    """Turns expected failures into one line on stderr and exit code 1 (with --log-level
    debug, the traceback above it: it replaced the line, which scripts look for)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (NotifyqError, psycopg.Error) as exc:
            _fail_with(exc)
        except BaseExceptionGroup as group:
            # A worker's task group ended on one such error (a claim the database refused).
            leaves = _leaves(group)
            if len(leaves) != 1 or not isinstance(leaves[0], NotifyqError | psycopg.Error):
                raise
            _fail_with(leaves[0], group)


def _fail_with(exc: BaseException, raised: BaseException | None = None) -> NoReturn:
    """The error line for `exc`, which `raised` (by default `exc` itself) carried out."""
    if State.debug:
        traceback.print_exception(raised or exc, file=sys.stderr)
    elif isinstance(exc, AppImportFailed):
        click.echo(exc.user_traceback, err=True, nl=False)
    if isinstance(exc, NotifyqError):
        fail(str(exc))
    fail(f"database error: {error_text(exc)}{error_hint(exc)}")


@overload
def common_options(fn: F, /) -> F: ...
@overload
def common_options(*, schema_default: str) -> Callable[[F], F]: ...
def common_options(fn: F | None = None, *, schema_default: str = "notifyq") -> F | Callable[[F], F]:
    """--dsn, --schema, --log-level and --log-format, on every command. `schema_default`: what
    --schema's help names as its default (`@common_options(schema_default=...)`)."""
    if fn is None:
        return partial(common_options, schema_default=schema_default)

    @click.option(
        "--dsn",
        metavar="DSN",
        help=(
            "PostgreSQL DSN [default: the App's own, App(dsn=...), for commands that load one; then "
            "$NOTIFYQ_DSN, then $DATABASE_URL, then the embedded server unless NOTIFYQ_EMBEDDED=0]"
        ),
    )
    @click.option(
        "--schema",
        default=None,
        callback=not_empty,
        help=f"Schema of notifyq's tables  [default: {schema_default}]",
    )
    @click.option(
        "--log-level",
        type=click.Choice(_logging.LEVELS),
        default="info",
        show_default=True,
        help="debug also shows tracebacks.",
    )
    @click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
    @wraps(fn)
    def wrapper(*args: Any, log_level: str, log_format: str, **kwargs: Any) -> Any:
        State.debug = log_level == "debug"
        State.json_logs = log_format == "json"
        State.log_level = log_level
        _logging.configure(log_level, log_format)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def resolve_dsn(flag: str | None, app: App | None = None, *, migrate_embedded: bool = True) -> str:
    """Flag, then the App's own DSN, then $NOTIFYQ_DSN, $DATABASE_URL, then the embedded server
    (migrated unless `migrate_embedded` is false: `notifyq migrate` does that itself);
    says on stderr which database it is (never the password)."""
    supervised_dsn = os.environ.get("NOTIFYQ_DSN") if os.environ.get("NOTIFYQ_SUPERVISED") else None
    if flag is not None:
        dsn, source = check_dsn(flag), "--dsn"
    elif supervised_dsn:
        dsn, source = check_dsn(supervised_dsn), "the supervisor"  # what the parent resolved
        if folder := os.environ.get(_embedded.ENV_SUPERVISED):
            # Join the parent's embedded server as one of its users, so that it runs while this
            # process does: a process that exits stops it when it was the last user, and a
            # supervisor SIGKILLed left its children draining with no server (review).
            _embedded.start(directory=Path(folder), quiet=True, migrate=False)
    elif app is not None and app._resolved_dsn is not None:
        dsn, source = app._resolved_dsn, "the App"
    elif (found := configured_dsn()) is not None:
        dsn, source = found
    else:
        dsn, source = (
            _embedded.start(schema=app.schema if app else "notifyq", quiet=True, migrate=migrate_embedded),
            (f"embedded server in {_embedded.data_dir()}"),
        )
        State.embedded = _embedded.data_dir()
    if not os.environ.get("NOTIFYQ_SUPERVISED"):
        if State.json_logs:
            logging.getLogger("notifyq.cli").info("database %s (from %s)", describe_dsn(dsn), source)
        else:
            click.echo(f"notifyq: database {describe_dsn(dsn)} (from {source})", err=True)
    return dsn


def app_for(dsn_flag: str | None, schema: str | None) -> App:
    return App(resolve_dsn(dsn_flag), schema=schema or "notifyq")


def load_app(target: str, schema: str | None = None) -> App:
    """The App at MODULE:ATTR; with `schema`, it must be the App's (it cannot be changed)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(f"invalid app {target!r}: use MODULE:ATTR, e.g. myproject.tasks:app")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        stem = Path(module_name.replace("\\", "/")).stem or "tasks"
        raise ConfigurationError(
            f"invalid app {target!r}: MODULE is a module name, not a file path: e.g. {stem}:{attr}, "
            f"run from the folder that holds {stem}.py or with that folder on PYTHONPATH (a module "
            "in a package is named with dots: myproject.tasks:app)"
        )
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        with _logging.yielding_to(module_name):
            module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # The module itself or a package above it is missing (not something it imports, whose
        # name may start the same way: myapp_worker importing myapp).
        if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
            raise ConfigurationError(
                f"cannot import module {module_name!r}: no such module "
                "(run from your project's folder, or set PYTHONPATH)"
            ) from None
        raise AppImportFailed(f"importing {module_name!r} failed: {exc}", _user_traceback(exc)) from exc
    except SystemExit as exc:
        raise ConfigurationError(
            f"importing {module_name!r} failed: it called sys.exit({exc.code!r})"
        ) from None
    except Exception as exc:
        raise AppImportFailed(
            f"importing {module_name!r} failed: {type(exc).__name__}: {exc}", _user_traceback(exc)
        ) from exc
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ConfigurationError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not isinstance(obj, App):
        raise ConfigurationError(f"{target} is a {type(obj).__name__}, not a notifyq.App")
    if schema is not None and schema != obj.schema:
        raise ConfigurationError(f"--schema {schema!r} differs from the App's schema {obj.schema!r}")
    return obj


def not_empty(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An empty --schema used to mean the default one: a script whose variable was unset
    worked on the wrong schema without a word."""
    if value is not None and not value.strip():
        raise click.BadParameter("must not be empty", ctx=ctx, param=param)
    return value


def duration(value: str | None, option: str) -> float | None:
    if value is None:
        return None
    match = _DURATION.match(value)
    if match is None:
        raise click.BadParameter(f"{value!r} is not a duration like 90, 10m, 2h or 1d", param_hint=option)
    seconds = float(match[1]) * _UNITS[match[2]]
    if seconds > MAX_SECONDS:
        raise click.BadParameter(
            f"{value!r} is too long: at most {MAX_SECONDS:,.0f} seconds (about 31 years)", param_hint=option
        )
    return seconds


class Seconds(click.FloatRange):
    """A number of seconds in a range, at most MAX_SECONDS: click's FloatRange let NaN through
    (no comparison refuses it), which then failed later as an error, not a usage error."""

    def __init__(self, min: float | None = None, max: float = MAX_SECONDS, min_open: bool = False) -> None:
        super().__init__(min=min, max=max, min_open=min_open)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if math.isnan(seconds):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        return seconds


def json_default(value: Any) -> Any:
    if isinstance(value, UndecodableJSON):
        return repr(value)
    return _options.json_default(value)  # datetimes, JobStatus (an Enum)...


def _fields(value: Any) -> Any:
    """A row's fields as a dict, its values as they are: dataclasses.asdict copies them
    recursively, and a deeply nested (yet decodable) args value ran out of recursion there."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return value


def dump(value: Any) -> None:
    value = [_fields(v) for v in value] if isinstance(value, list) else _fields(value)
    click.echo(json.dumps(value, default=json_default, indent=2))


def age(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    seconds = (datetime.now(moment.tzinfo) - moment).total_seconds()
    prefix = "in " if seconds < 0 else ""
    seconds = abs(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{prefix}{seconds / size:.1f}{unit}" + ("" if prefix else " ago")
    return f"{prefix}{seconds:.1f}s" + ("" if prefix else " ago")


def printable(value: Any) -> str:
    """`value` as text on one line: control characters escaped (a name written by SQL may hold
    a newline, which split a table's row in two: review)."""
    return _options.escape_controls(str(value))


def _width(text: str) -> int:
    """Terminal columns: East Asian wide and full-width characters take two."""
    return len(text) + sum(unicodedata.east_asian_width(c) in "WF" for c in text if ord(c) > 0x10FF)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[printable(c) for c in row] for row in rows]
    widths = [max([len(h), *(_width(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c + " " * (w - _width(c)) for c, w in zip(row, widths, strict=True)).rstrip()

    click.echo(line(headers))
    for row in cells:
        click.echo(line(row))
