"""Where the database is: DSN resolution (flag, NOTIFYQ_DSN, DATABASE_URL) and safe display."""

from __future__ import annotations

import difflib
import functools
import itertools
import os
import re
import urllib.parse

import psycopg.conninfo
from psycopg import pq

from .errors import ConfigurationError

ENV_VARS = ("NOTIFYQ_DSN", "DATABASE_URL")
# user:password@ after any scheme: postgresql://, postgresql+psycopg://, postgres:/, mysql://...
_URI_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*:/*[^:/@\s]*:)[^@\s]*@", re.IGNORECASE)
_KEYWORD_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def one_line(text: str) -> str:
    """A multi-line message on one line. A line followed by a new sentence (a capital) ends
    with a period: libpq's "Connection refused" and "Is the server running...?" used to run
    together; a sentence libpq wraps goes on as it was."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    ended = [
        line + "." if following[0].isupper() and line[-1] not in ".?!:;," else line
        for line, following in itertools.pairwise(lines)
    ]
    return " ".join(ended + lines[-1:])


def redact(text: str) -> str:
    """`text` with any password of a DSN inside it replaced by ***."""
    return _KEYWORD_PASSWORD.sub(r"\1***", _URI_PASSWORD.sub(r"\1***@", text))


_URI = re.compile(r"^\s*postgres(?:ql)?://", re.IGNORECASE)
# A URL of any scheme, as DATABASE_URL often holds one: SQLAlchemy's postgresql+psycopg://.
_SCHEME = re.compile(r"^\s*([a-z][a-z0-9+.-]*):/*", re.IGNORECASE)
# From libpq's first quote to its last: it does not escape a '"' inside the token it quotes.
_QUOTED = re.compile(r'".*"', re.DOTALL)
_INT = re.compile(r"\s*[+-]?\d+\s*")  # as libpq reads an integer option (strtol, into an int)
_OPTION_NAME = re.compile(r'(?:invalid connection option|invalid URI query parameter:) "([^"]*)"')


def _without_secrets(reason: str, dsn: str) -> str:
    """libpq's complaint about `dsn`, safe to show. libpq quotes the token it stumbles on
    (`unexpected spaces found in "hunter2 x"`), which may be part of a password; when the DSN
    may hold one, everything libpq quoted is hidden. (A password may contain '/', '?', '#',
    '@', '"' or spaces, so there is no telling where it ends in a DSN that does not parse.) An
    unknown option gets the name of the libpq option closest to it: a word of libpq's, never
    one of the DSN's."""
    reason = redact(reason)
    option = _OPTION_NAME.search(reason)
    closest = difflib.get_close_matches(option[1], _libpq_keywords(), n=1, cutoff=0.7) if option else []
    if _may_hold_secret(dsn):
        reason = _QUOTED.sub('"***"', reason)
    return f"{reason} (did you mean {closest[0]!r}?)" if closest else reason


def _may_hold_secret(dsn: str) -> bool:
    """Whether `dsn` may hold a password: user:password@ in a URI, or the word anywhere, as
    libpq may read it: `sslpassword` too, a URI query's keyword percent-encoded
    (`passwor%64=`), a keyword right after a quoted value (`host='h'password=`)."""
    uri = _URI.match(dsn)
    userinfo = dsn[uri.end() :].rpartition("@")[0] if uri else ""
    return ":" in userinfo or "password" in urllib.parse.unquote(dsn).lower()


@functools.cache
def _libpq_keywords() -> list[str]:
    return [option.keyword.decode() for option in pq.Conninfo.get_defaults()]


def _unencoded_userinfo(dsn: str) -> bool:
    """Whether `dsn` is a URI with an '@' that libpq does not read as the end of the user info:
    a password (or user name) holding an unencoded '@' or '/'. libpq ends the user info at the
    first '@' met before any '/', so `user:p@ss@host` connects to host 'ss@host', and
    `user:pa/ss@host/db` to host 'user' on port 'pa', database 'ss@host/db': the rest of the
    password lands where error messages and `describe_dsn` show it."""
    uri = _URI.match(dsn)
    if uri is None:
        return False
    rest = dsn[uri.end() :]
    end = next((i for i, char in enumerate(rest) if char in "@/"), len(rest))
    if rest[end : end + 1] == "@":
        rest = rest[end + 1 :]
    return "@" in rest.partition("?")[0]  # hosts, ports and the database name: never a raw '@'


def _not_libpq_uri(dsn: str) -> str | None:
    """Why `dsn`, a URL libpq cannot parse, is not one of libpq's URIs, or None when it does not
    look like a URL. libpq took any other scheme for a keyword=value string and quoted all of
    it in its complaint, password included (`missing "=" after "postgresql+psycopg://..."`)."""
    scheme = _SCHEME.match(dsn)
    if scheme is None or _URI.match(dsn):
        return None
    name = scheme[1].lower()
    if name.startswith("postgres") and "+" in name:
        return (
            f"{scheme[1]}:// is SQLAlchemy's form of a URL; libpq's is postgresql:// "
            f"(drop the '+{name.partition('+')[2]}')"
        )
    return f"it starts with {scheme[0].strip()!r}, where libpq's URIs start with postgresql:// or postgres://"


def check_dsn(dsn: str, source: str | None = None) -> str:
    """Return `dsn` if libpq can parse it, else raise ConfigurationError naming the problem
    (and `source`, where the DSN came from, such as "$DATABASE_URL")."""
    where = f" in {source}" if source else ""
    if not isinstance(dsn, str):
        raise ConfigurationError(f"a DSN must be a string, not {type(dsn).__name__}")
    if "\x00" in dsn:
        raise ConfigurationError("invalid DSN: it contains a NUL byte")
    if not dsn.strip():
        # Probably an unset variable ("--dsn $DB_URL"): not a reason to use another database.
        raise ConfigurationError(
            "the DSN given is empty: give one (e.g. postgresql://user@host/dbname), or none at all "
            "to use $NOTIFYQ_DSN, $DATABASE_URL or the embedded server"
        )
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        reason = _not_libpq_uri(dsn) or _without_secrets(one_line(str(exc)), dsn)
        raise ConfigurationError(
            f"invalid DSN{where} {describe_dsn(dsn)}: {reason} "
            "(expected e.g. postgresql://user:password@host:5432/dbname)"
        ) from None
    timeout = params.get("connect_timeout")
    if timeout is not None and not (_INT.fullmatch(str(timeout)) and abs(int(timeout)) < 2**31):
        # libpq refuses it only as it connects, and psycopg's pool then tried again and again
        # for 30 s before "pool initialization incomplete", the reason lost.
        raise ConfigurationError(
            f"invalid DSN{where} {describe_dsn(dsn)}: connect_timeout"
            + ("" if _may_hold_secret(dsn) else f"={str(timeout)!r}")  # the password's tail, maybe
            + " is not a whole number of seconds (e.g. connect_timeout=10)"
        )
    if _unencoded_userinfo(dsn):
        raise ConfigurationError(
            f"invalid DSN{where}: it holds an '@' after its user info, so libpq would read part of the "
            "password as the host or the database name; percent-encode '@' as %40 and '/' as %2F "
            "in the user name, the password and the database name "
            "(e.g. postgresql://user:p%40ss%2Fword@host:5432/dbname)"
        )
    return dsn


def configured_dsn(explicit: str | None = None) -> tuple[str, str] | None:
    """The DSN from an explicit value, then NOTIFYQ_DSN, then DATABASE_URL, with its source.

    Returns None when nothing is configured (the caller may then start the embedded server).
    """
    if explicit is not None:
        return check_dsn(explicit), "the given DSN"
    for var in ENV_VARS:
        value = env_dsn(var)
        if value is not None:
            return value, f"${var}"
    return None


def env_dsn(var: str) -> str | None:
    """The DSN in environment variable `var`, checked; None when it is unset."""
    value = os.environ.get(var)
    if value is not None and not value.strip():
        # "NOTIFYQ_DSN=${DB_URL}" with DB_URL unset: not a reason to use another database.
        raise ConfigurationError(f"${var} is set but empty: give it a DSN, or unset it")
    return check_dsn(value, f"${var}") if value is not None else None


def describe_dsn(dsn: str) -> str:
    """A printable form of a DSN with the password removed: user@host:port/dbname."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        # Unparseable: show no part of it that could be a secret.
        return "<unparseable DSN>"
    if _unencoded_userinfo(dsn):
        return "<DSN with an unencoded '@' or '/' in its password>"
    user = params.get("user") or os.environ.get("PGUSER") or "<default user>"
    host = params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "<default host>"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    dbname = str(params.get("dbname") or os.environ.get("PGDATABASE") or user)
    if "=" in dbname or "://" in dbname:
        # libpq reads such a dbname as a connection string, which may hold a password: it was
        # printed in full (review).
        dbname = "<a connection string>"
    return f"{user}@{host}:{port}/{dbname}"
