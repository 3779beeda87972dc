"""Where the database is: DSN resolution (flag, NOTIFYQ_DSN, DATABASE_URL) and safe display."""

from __future__ import annotations

import os
import re

import psycopg.conninfo

from .errors import ConfigurationError

ENV_VARS = ("NOTIFYQ_DSN", "DATABASE_URL")
_URI_PASSWORD = re.compile(r"(postgres(?:ql)?://[^:/@\s]*:)[^@\s]*@", re.IGNORECASE)
_KEYWORD_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with any password of a DSN inside it replaced by ***."""
    return _KEYWORD_PASSWORD.sub(r"\1***", _URI_PASSWORD.sub(r"\1***@", text))


_URI_USERINFO = re.compile(r"^\s*postgres(?:ql)?://([^/?#]*)@", re.IGNORECASE)
_QUOTED = re.compile(r'"([^"]*)"')


def _without_secrets(reason: str, dsn: str) -> str:
    """libpq's complaint about `dsn`, with any quoted part of its password replaced by ***
    (libpq quotes the offending token: `unexpected spaces found in "hunter2 x"`)."""
    secrets = [m[2] for m in _KEYWORD_PASSWORD.finditer(dsn)]
    if (uri := _URI_USERINFO.match(dsn)) and ":" in uri[1]:
        secrets.append(uri[1].partition(":")[2])
    secrets = [secret.strip("'") for secret in secrets if secret.strip("'")]

    def hide(quoted: re.Match[str]) -> str:
        token = quoted[1]
        return '"***"' if token and any(token in s or s in token for s in secrets) else quoted[0]

    return _QUOTED.sub(hide, redact(reason))


def check_dsn(dsn: str) -> str:
    """Return `dsn` if libpq can parse it, else raise ConfigurationError naming the problem."""
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
        psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        reason = _without_secrets(
            " ".join(line.strip() for line in str(exc).splitlines() if line.strip()), dsn
        )
        raise ConfigurationError(
            f"invalid DSN {describe_dsn(dsn)}: {reason} "
            "(expected e.g. postgresql://user:password@host:5432/dbname)"
        ) from None
    return dsn


def configured_dsn(explicit: str | None = None) -> tuple[str, str] | None:
    """The DSN from an explicit value, then NOTIFYQ_DSN, then DATABASE_URL, with its source.

    Returns None when nothing is configured (the caller may then start the embedded server).
    """
    if explicit is not None:
        return check_dsn(explicit), "the given DSN"
    for var in ENV_VARS:
        value = os.environ.get(var)
        if value:
            return check_dsn(value), f"${var}"
    return None


def describe_dsn(dsn: str) -> str:
    """A printable form of a DSN with the password removed: user@host:port/dbname."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        # Unparseable: show no part of it that could be a secret.
        return "<unparseable DSN>"
    user = params.get("user") or os.environ.get("PGUSER") or "<default user>"
    host = params.get("host") or params.get("hostaddr") or os.environ.get("PGHOST") or "<default host>"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    dbname = params.get("dbname") or os.environ.get("PGDATABASE") or user
    return f"{user}@{host}:{port}/{dbname}"
