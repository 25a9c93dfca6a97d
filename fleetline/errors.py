"""One exception root for fleetline; third-party errors are translated into these at the edges."""

from __future__ import annotations


class FleetlineError(Exception):
    """Root of every error fleetline raises on purpose."""


class ConfigError(FleetlineError):
    """A setting is missing or malformed."""


class DecodeError(FleetlineError):
    """Bytes from a topic could not be turned into a known event."""


class UnknownSchemaError(DecodeError):
    """The message names a schema fingerprint that no registered schema has."""


class EncodeError(FleetlineError):
    """A record does not fit the schema it is written with."""


class SchemaError(FleetlineError):
    """A schema file is invalid, duplicated or incompatible with its predecessor."""


class StorageError(FleetlineError):
    """A storage backend (ClickHouse, object store) failed."""


class TransientStorageError(StorageError):
    """The backend may succeed if the same operation is retried."""


class ObjectMissing(StorageError):
    """The object is not there: never written, or removed (a live process prunes snapshots and
    moves tiered data) after the reader listed it."""


class IntegrityError(StorageError):
    """Stored data contradicts what was written (checksum, row count, schema version)."""


class StreamError(FleetlineError):
    """Kafka transport failed in a way the processor loop could not absorb."""


class StoryStalled(FleetlineError):
    """A part of a played scenario did not reach what it waits for in time (a job not
    running, not moved, not placed): that story step did not happen, and the run goes on to
    say so (`demo/verdict.py`)."""


class ServiceUnavailable(FleetlineError):
    """A service a command needs (Kafka, the S3 server, a ClickHouse server) does not answer;
    the message names it, its address and what to do. Commands exit with EXIT_UNAVAILABLE."""


# sysexits.h EX_UNAVAILABLE: distinct from a usage error (2) and a refused input (1).
EXIT_UNAVAILABLE = 69


class NotPermitted(FleetlineError):
    """The command needs a privilege this process lacks (root, for the lab's namespaces and
    links). Commands exit with EXIT_NOPERM."""


# sysexits.h EX_NOPERM.
EXIT_NOPERM = 77


class ServiceError(FleetlineError):
    """A local service (broker, object store) could not be fetched, built, started or stopped."""


class InvalidEventError(DecodeError):
    """An event decoded but breaks a rule of its type (value out of range, unknown type)."""


class QueryError(StorageError):
    """ClickHouse rejected a query (syntax, unknown column, permissions)."""


class AuthError(FleetlineError):
    """A request was refused by authentication or authorisation."""


class AuthenticationError(AuthError):
    """No valid credentials: missing, malformed, expired, wrong audience, bad signature (401)."""


class PermissionDenied(AuthError):
    """Valid credentials, but the role or tenant scope does not allow the operation (403)."""
