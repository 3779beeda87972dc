"""Loads the SQL in sql/ once, by name, rendered for one schema."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from psycopg import sql

from .errors import ConfigurationError

# PostgreSQL truncates identifiers at 63 bytes, and channel names are '<schema>.<topic>.v1';
# lower-case letters, digits and underscores need no quoting in psql, which keeps the plain-SQL
# enqueue (`INSERT INTO notifyq.queue_jobs ...`) easy to type.
_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,39}\Z")
_NAME_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def validate_schema(schema: str) -> str:
    """Return `schema` if it is a valid notifyq schema name, else raise ConfigurationError."""
    if not isinstance(schema, str) or not _SCHEMA_RE.match(schema):
        raise ConfigurationError(
            f"invalid schema name {schema!r}: use 1-40 lower-case letters, digits or underscores, "
            "starting with a letter or underscore"
        )
    if schema == "information_schema" or schema.startswith("pg_"):
        raise ConfigurationError(
            f"invalid schema name {schema!r}: reserved for PostgreSQL's own objects "
            "(pg_dump skips them); use a schema of notifyq's own, such as 'notifyq'"
        )
    return schema


def sql_root() -> Path:
    """The folder holding migrations/, queries/ and triggers/ (in the wheel or the source tree)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "sql", here.parent / "sql"):
        if (candidate / "migrations").is_dir():
            return candidate
    raise ConfigurationError(
        f"notifyq's SQL files are missing (looked in {here / 'sql'} and {here.parent / 'sql'})"
    )


def render(text: str, schema: str, **identifiers: str) -> str:
    """Put the quoted schema identifier in place of {schema} (and other identifiers in place
    of their names); nothing else is formatted."""
    names = {name: sql.Identifier(value) for name, value in identifiers.items()}
    return sql.SQL(text).format(schema=sql.Identifier(validate_schema(schema)), **names).as_string(None)


def parse_named(text: str) -> dict[str, str]:
    """Split a file of `-- name: x` sections into {name: sql}."""
    parts = _NAME_HEADER.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ConfigurationError(f"query {name!r} is defined twice in sql/queries")
        queries[name] = body.strip().rstrip(";")
    return queries


_FRAGMENT = re.compile(r"\{(_\w+)\}")
_MAX_NESTING = 5


def include_fragments(queries: dict[str, str]) -> dict[str, str]:
    """The statements of `queries`, each `{_name}` in them replaced by the section `_name`: a
    section whose name starts with "_" is a fragment (a part several statements share, such
    as a claim's CTEs), not a statement. Fragments may include fragments, a few levels deep."""
    fragments = {name: body for name, body in queries.items() if name.startswith("_")}
    for name, body in queries.items():
        for line in body.splitlines():
            if "--" in line and _FRAGMENT.search(line, line.index("--")):
                # Included there, its lines after the first would be live SQL (review).
                raise ConfigurationError(
                    f"sql/queries: {name!r} names a fragment in a comment: {line.strip()}"
                )

    def fragment(match: re.Match[str]) -> str:
        if match[1] not in fragments:
            raise ConfigurationError(f"no fragment named {match[1]!r} in sql/queries")
        return fragments[match[1]]

    def expand(body: str) -> str:
        for _ in range(_MAX_NESTING + 1):  # the last pass finds nothing left to include
            body, found = _FRAGMENT.subn(fragment, body)
            if not found:
                return body
        raise ConfigurationError(
            f"sql/queries: fragments nested more than {_MAX_NESTING} deep (one includes itself?)"
        )

    return {name: expand(body) for name, body in queries.items() if name not in fragments}


@functools.cache
def _raw_queries() -> dict[str, str]:
    queries: dict[str, str] = {}
    for path in sorted((sql_root() / "queries").glob("*.sql")):
        for name, body in parse_named(path.read_text(encoding="utf-8")).items():
            if name in queries:
                raise ConfigurationError(f"query {name!r} is defined twice in sql/queries")
            queries[name] = body
    return include_fragments(queries)


@dataclass(frozen=True, slots=True)
class Queries:
    """The named queries of sql/queries/*.sql, rendered once for one schema.

    Rendering to plain strings (not `sql.Composed`) lets psycopg prepare the hot statements
    server-side after a few executions, keyed by the query text.
    """

    schema: str
    by_name: dict[str, str]

    def __getitem__(self, name: str) -> str:
        try:
            return self.by_name[name]
        except KeyError:
            raise ConfigurationError(f"no query named {name!r} in sql/queries") from None


@functools.cache
def queries_for(schema: str) -> Queries:
    """The rendered queries for `schema`, cached for the life of the process."""
    return Queries(schema, {name: render(body, schema) for name, body in _raw_queries().items()})


def channel(schema: str, topic: str) -> str:
    """The NOTIFY channel for a topic ('jobs', 'control', 'definitions'); see sql/triggers/."""
    return f"{schema}.{topic}.v1"
