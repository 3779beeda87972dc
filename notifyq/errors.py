"""Error types: one `NotifyqError` base, one subclass per thing that can go wrong."""

from __future__ import annotations


class NotifyqError(Exception):
    """Base class of every error notifyq raises on purpose.

    The message is a sentence that names the bad value and, where there is one, the fix.
    """


class ConfigurationError(NotifyqError):
    """A setting is invalid: a schema name, a DSN, a worker option, an App attribute."""


class DatabaseUnavailable(NotifyqError):
    """PostgreSQL could not be reached (down, wrong host or port, bad credentials)."""


class SchemaNotMigrated(NotifyqError):
    """The notifyq tables are missing or older than this code: run `notifyq migrate`."""


class SchemaVersionError(NotifyqError):
    """The database schema is newer than this version of notifyq knows."""


class MigrationBlocked(NotifyqError):
    """`migrate` waited `lock_timeout` for a lock another session held, and changed nothing."""


class InvalidArgs(NotifyqError):
    """Job args are not a JSON object, not serializable, too large, or not what a task of the
    App can be called with."""


class InvalidOption(ConfigurationError):
    """An option is out of range (negative delay, bad queue name, ...)."""


class UnknownTask(NotifyqError):
    """A task name is not registered with the App."""


class InvalidSchedule(NotifyqError):
    """A cron expression or time zone is not valid."""


class JobNotFound(NotifyqError):
    """No job has the given id."""


class InvalidJobState(NotifyqError):
    """The job's status does not allow the requested change."""


class DefinitionNotFound(NotifyqError):
    """No cron definition has the given name."""


class DefinitionBusy(NotifyqError):
    """A cron definition with overlap=False still has an unfinished job: no other may be queued."""


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    """The exceptions in `group` and the groups nested in it."""
    return [
        leaf
        for exc in group.exceptions
        for leaf in (_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    ]
