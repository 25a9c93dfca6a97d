"""Settings read once from the environment; every adapter takes them explicitly."""

from __future__ import annotations

import base64
import ipaddress
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from fleetline.errors import ConfigError
from fleetline.identity.keys import decode_root, derive, read_root, root_key_path, signer_for
from fleetline.identity.keys import read_credentials as read_identity_file
from fleetline.identity.writers import CONTROL_PLANE_WRITER, Signer, Writer
from fleetline.tls import TlsSettings

# The checkout this package is installed from (editable), where .data/ and .cache/ live.
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class KafkaSettings:
    bootstrap_servers: str = "127.0.0.1:19092"
    # Passed through verbatim to every client, e.g. security.protocol, sasl.mechanism.
    client_overrides: Mapping[str, str] = field(default_factory=dict)
    # The replication of every topic fleetline creates (-1: the cluster's
    # default.replication.factor) and its min.insync.replicas (None: the cluster's default).
    replication_factor: int = -1
    min_insync_replicas: int | None = None
    # How long a consumer group waits for a member that stopped heartbeating (a killed
    # process) before its partitions go to another (None: librdkafka's 45 s).
    session_timeout_ms: int | None = None
    # On a secured broker, a launcher (`fleetline run`) holds each kind of process's sign-in
    # (kind -> client settings) and hands each process its own (`as_kind`); empty otherwise.
    principals: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Who this process writes as (identity/writers.py): every record it produces carries its
    # writer and a MAC by that writer's key. None: records go unsigned, and the folds refuse
    # them wherever a writer's authority is checked.
    signer: Signer | None = field(default=None, repr=False)
    # The deployment's identity root (control plane only): what the folds check writers with.
    identity_root: bytes | None = field(default=None, repr=False)
    # A host's credential file from `fleetline enroll` (FLEETLINE_IDENTITY_FILE).
    identity_file: Path | None = None

    def writing_as(self, *writers: Writer) -> KafkaSettings:
        """These settings writing as `writers` (a node agent's nodes, a cluster agent's
        cluster, ...): their credentials from this host's identity file, or derived from the
        root where this host holds it; ConfigError saying how to enrol otherwise."""
        signer = signer_for(writers, root=self.identity_root, identity_file=self.identity_file)
        return replace(self, signer=signer)

    def as_kind(self, kind: str) -> KafkaSettings:
        """These settings signed in as a process of `kind` (unchanged on a plaintext broker)."""
        if not self.principals:
            return self
        return replace(
            self,
            client_overrides={**self.client_overrides, **self.principals[kind]},
            principals={},
        )

    def as_env(self) -> dict[str, str]:
        """The FLEETLINE_KAFKA_* variables `Settings.from_env` reads back (for a child
        process: give it `as_kind(...)`'s)."""
        return {
            "FLEETLINE_KAFKA_BOOTSTRAP": self.bootstrap_servers,
            **({"FLEETLINE_IDENTITY_FILE": str(self.identity_file)} if self.identity_file else {}),
            **{
                "FLEETLINE_KAFKA_CONF_" + key.upper().replace(".", "_"): value
                for key, value in self.client_overrides.items()
            },
        }

    def client_config(self, **extra: object) -> dict[str, object]:
        # librdkafka's own log lines go through Python logging, not straight to stderr.
        conf: dict[str, object] = {
            "bootstrap.servers": self.bootstrap_servers,
            "logger": logging.getLogger("fleetline.librdkafka"),
        }
        conf.update(self.client_overrides)
        conf.update(extra)
        return conf


@dataclass(frozen=True)
class S3Settings:
    endpoint: str = "127.0.0.1:19000"
    access_key: str = "fleetline"
    secret_key: str = "fleetline-secret"
    secure: bool = False
    region: str = "us-east-1"
    bucket: str = "fleetline"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> S3Settings:
        defaults = cls()
        return cls(
            endpoint=env.get("FLEETLINE_S3_ENDPOINT", defaults.endpoint),
            access_key=env.get("FLEETLINE_S3_ACCESS_KEY", defaults.access_key),
            secret_key=env.get("FLEETLINE_S3_SECRET_KEY", defaults.secret_key),
            secure=_flag(env.get("FLEETLINE_S3_SECURE", "false"), "FLEETLINE_S3_SECURE"),
            region=env.get("FLEETLINE_S3_REGION", defaults.region),
            bucket=env.get("FLEETLINE_S3_BUCKET", defaults.bucket),
        )

    def as_env(self) -> dict[str, str]:
        """The FLEETLINE_S3_* variables `from_env` reads back (for a child process)."""
        return {
            "FLEETLINE_S3_ENDPOINT": self.endpoint,
            "FLEETLINE_S3_ACCESS_KEY": self.access_key,
            "FLEETLINE_S3_SECRET_KEY": self.secret_key,
            "FLEETLINE_S3_SECURE": "true" if self.secure else "false",
            "FLEETLINE_S3_REGION": self.region,
            "FLEETLINE_S3_BUCKET": self.bucket,
        }


@dataclass(frozen=True)
class QueryLimits:
    """What one analyst query (`fleetline sql`, `fleetline query`, the API's SQL and ready
    queries) may take, so that no query starves the view, the scheduler or the sinks that share
    the store. ClickHouse enforces them; a query cannot lift them (see storage/query_service.py)."""

    max_execution_s: float = 30.0
    max_memory_bytes: int = 2 * 1024**3
    max_result_rows: int = 100_000
    max_result_bytes: int = 64 * 1024**2

    def clickhouse_settings(self) -> dict[str, str | int | float]:
        return {
            "max_execution_time": self.max_execution_s,
            "timeout_overflow_mode": "throw",
            "max_memory_usage": self.max_memory_bytes,
            "max_result_rows": self.max_result_rows,
            "max_result_bytes": self.max_result_bytes,
            "result_overflow_mode": "throw",
        }


@dataclass(frozen=True)
class Settings:
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    s3: S3Settings = field(default_factory=S3Settings)
    # chdb:///path (embedded, the default) or http(s)://host:port (a ClickHouse server).
    clickhouse_url: str = f"chdb://{REPO_ROOT / '.data' / 'clickhouse'}"
    clickhouse_database: str = "fleetline"
    cache_dir: Path = REPO_ROOT / ".cache"
    # Security (see docs/security.md): the API's token/JWT config file,
    # the audit chainer's Ed25519 signing key (created on first use when absent), the public
    # keys `audit verify` trusts (default: the signing key's own), and the AES-256 key for
    # objects written to S3 (base64; none = stored as they are).
    auth_config: Path | None = None
    audit_signing_key: Path | None = None
    audit_verify_keys: tuple[Path, ...] = ()
    object_encryption_key: str | None = None
    query_limits: QueryLimits = field(default_factory=QueryLimits)
    # The largest request body the API reads (a spec file, a policy, a query); larger: 413.
    api_max_body_bytes: int = 1024 * 1024
    # The address this host's processes listen on and tell others to reach them at: the API,
    # the router, inference replicas, the cluster agent's peer probe, the query service and
    # /metrics (each command's own --host flag overrides it). Loopback suits one host only.
    advertise_host: str = "127.0.0.1"
    # TLS between the router and the inference replicas, with the deployment's CA (see tls.py);
    # None: plain HTTP.
    tls: TlsSettings | None = None

    def as_kind(self, kind: str) -> Settings:
        """These settings as a process of `kind` signs in to Kafka with (see KafkaSettings)."""
        return replace(self, kafka=self.kafka.as_kind(kind))

    def with_identity_root(self, *, create: bool = True) -> Settings:
        """These settings holding the deployment's identity root (FLEETLINE_IDENTITY_ROOT_KEY,
        or the key made owner-only in the cache on the control plane's first start) and writing
        as the control plane unless they write as someone already."""
        root = self.kafka.identity_root or read_root(root_key_path(self.cache_dir), create=create)
        if root is None:
            return self
        signer = self.kafka.signer or derive(root, [CONTROL_PLANE_WRITER])
        return replace(self, kafka=replace(self.kafka, identity_root=root, signer=signer))

    def writing_as(self, *writers: Writer) -> Settings:
        """These settings writing as `writers` (see KafkaSettings.writing_as)."""
        return replace(self, kafka=self.kafka.writing_as(*writers))

    def deployment_ca_path(self) -> Path:
        """The directory of this host's deployment CA (infra/ca.py), made on first use."""
        return self.cache_dir / "ca"

    def deployment_key_path(self) -> Path:
        return self.cache_dir / "keys" / "object-encryption.key"

    def with_deployment_key(self, *, create: bool = True) -> Settings:
        """These settings sealing objects by default: FLEETLINE_OBJECT_ENCRYPTION_KEY, or the
        deployment key made (random, owner-only) on first start like the audit signing key
        (`create`; without it, the key only where this host's deployment already made one).
        Other hosts' processes must be given it as FLEETLINE_OBJECT_ENCRYPTION_KEY."""
        if self.object_encryption_key:
            return self
        path = self.deployment_key_path()
        if not path.exists():
            if not create:
                return self
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                handle.write(base64.b64encode(os.urandom(32)).decode())
        return replace(self, object_encryption_key=path.read_text().strip())

    def object_key(self) -> bytes | None:
        """The object-encryption key's bytes (the setting is base64), or None when unset."""
        key = self.object_encryption_key
        return base64.b64decode(key) if key else None

    def signing_key_path(self) -> Path:
        return self.audit_signing_key or self.cache_dir / "audit" / "signing-key.pem"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        defaults = cls()
        limits = defaults.query_limits
        overrides = {
            key.removeprefix("FLEETLINE_KAFKA_CONF_").lower().replace("_", "."): value
            for key, value in env.items()
            if key.startswith("FLEETLINE_KAFKA_CONF_")
        }
        kafka = KafkaSettings(
            bootstrap_servers=env.get(
                "FLEETLINE_KAFKA_BOOTSTRAP", defaults.kafka.bootstrap_servers
            ),
            client_overrides=overrides,
            # Unset: -1 and None, the cluster's defaults; set: a positive number.
            replication_factor=_number(
                env, "FLEETLINE_KAFKA_REPLICATION", defaults.kafka.replication_factor
            ),
            min_insync_replicas=_number(env, "FLEETLINE_KAFKA_MIN_INSYNC", 0) or None,
            session_timeout_ms=_number(env, "FLEETLINE_KAFKA_SESSION_TIMEOUT_MS", 0) or None,
        )
        cache_dir = Path(env.get("FLEETLINE_CACHE_DIR", str(defaults.cache_dir)))
        identity_file = (
            Path(env["FLEETLINE_IDENTITY_FILE"]) if env.get("FLEETLINE_IDENTITY_FILE") else None
        )
        root = (
            decode_root(env["FLEETLINE_IDENTITY_ROOT_KEY"], "FLEETLINE_IDENTITY_ROOT_KEY")
            if env.get("FLEETLINE_IDENTITY_ROOT_KEY")
            else read_root(root_key_path(cache_dir), create=False)
        )
        # A host given credentials writes as the first of them until a command says whom it
        # speaks for; the control plane's host writes as the control plane.
        signer = None
        if identity_file is not None:
            signer = read_identity_file(identity_file)
        elif root is not None:
            signer = derive(root, [CONTROL_PLANE_WRITER])
        kafka = replace(kafka, signer=signer, identity_root=root, identity_file=identity_file)
        return cls(
            kafka=kafka,
            s3=S3Settings.from_env(env),
            clickhouse_url=env.get("FLEETLINE_CLICKHOUSE_URL", defaults.clickhouse_url),
            clickhouse_database=env.get(
                "FLEETLINE_CLICKHOUSE_DATABASE", defaults.clickhouse_database
            ),
            cache_dir=cache_dir,
            auth_config=Path(env["FLEETLINE_AUTH_CONFIG"])
            if env.get("FLEETLINE_AUTH_CONFIG")
            else None,
            audit_signing_key=Path(env["FLEETLINE_AUDIT_SIGNING_KEY"])
            if env.get("FLEETLINE_AUDIT_SIGNING_KEY")
            else None,
            audit_verify_keys=tuple(
                Path(p) for p in env.get("FLEETLINE_AUDIT_VERIFY_KEYS", "").split(",") if p
            ),
            object_encryption_key=env.get("FLEETLINE_OBJECT_ENCRYPTION_KEY") or None,
            query_limits=QueryLimits(
                max_execution_s=_number(env, "FLEETLINE_SQL_MAX_SECONDS", limits.max_execution_s),
                max_memory_bytes=_number(
                    env, "FLEETLINE_SQL_MAX_MEMORY_BYTES", limits.max_memory_bytes
                ),
                max_result_rows=_number(
                    env, "FLEETLINE_SQL_MAX_RESULT_ROWS", limits.max_result_rows
                ),
                max_result_bytes=_number(
                    env, "FLEETLINE_SQL_MAX_RESULT_BYTES", limits.max_result_bytes
                ),
            ),
            api_max_body_bytes=_number(
                env, "FLEETLINE_API_MAX_BODY_BYTES", defaults.api_max_body_bytes
            ),
            advertise_host=host_address(
                env.get("FLEETLINE_ADVERTISE_HOST") or defaults.advertise_host,
                "FLEETLINE_ADVERTISE_HOST",
            ),
            tls=TlsSettings.from_env(env),
        )


_HOST_NAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+$")


def mapping_file(path: str, what: str) -> Mapping[str, Any]:
    """A YAML (or JSON) file holding one mapping, e.g. a policy: ConfigError naming `what` and
    the file when it cannot be read, is not YAML or is not a mapping."""
    import yaml

    try:
        with open(path) as handle:
            data = yaml.safe_load(handle) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{what} {path}: {exc}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{what} {path}: must be a mapping")
    return data


def host_address(value: str, what: str) -> str:
    """An address to listen on and be reached at: an IP address or a host name. Not a wildcard:
    others must be able to reach what is advertised, and 0.0.0.0 reaches no one."""
    text = value.strip()
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        if not _HOST_NAME.match(text) or text.replace(".", "").isdigit():
            raise ConfigError(
                f"{what} must be an IP address or a host name, got {value!r}"
            ) from None
        return text
    if address.is_unspecified:
        raise ConfigError(
            f"{what} must be an address others can reach, not the wildcard {text} "
            "(give this host's address on the network they share)"
        )
    return text


def _flag(value: str, name: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ConfigError(f"{name} must be true or false, got {value!r}")


N = TypeVar("N", int, float)


def _number(env: Mapping[str, str], name: str, default: N) -> N:
    """A positive number (of the default's type) from the environment, or the default; anything
    else names the variable."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    kind = type(default)
    try:
        value = kind(raw.strip().replace("_", ""))
    except ValueError:
        raise ConfigError(f"{name} must be a {kind.__name__}, got {raw!r}") from None
    if value <= 0:
        raise ConfigError(f"{name} must be above 0, got {raw!r}")
    return value
