"""Settings from the environment (no services)."""

from __future__ import annotations

import pytest

from fleetline.config import Settings
from fleetline.errors import ConfigError
from fleetline.infra import LocalServices


def test_defaults_point_at_the_local_services() -> None:
    settings = Settings.from_env({})
    assert settings.kafka.bootstrap_servers == "127.0.0.1:19092"
    assert settings.clickhouse_url.startswith("chdb://")
    assert settings.s3.secure is False


def test_environment_overrides_and_kafka_passthrough() -> None:
    settings = Settings.from_env(
        {
            "FLEETLINE_KAFKA_BOOTSTRAP": "broker:9093",
            "FLEETLINE_KAFKA_CONF_SECURITY_PROTOCOL": "SASL_SSL",
            "FLEETLINE_S3_SECURE": "yes",
            "FLEETLINE_CLICKHOUSE_URL": "https://ch.example:8443",
        }
    )
    conf = settings.kafka.client_config(**{"group.id": "g"})
    assert conf["bootstrap.servers"] == "broker:9093"
    assert conf["security.protocol"] == "SASL_SSL"
    assert conf["group.id"] == "g"
    assert settings.s3.secure is True
    assert settings.clickhouse_url == "https://ch.example:8443"


def test_bad_values_are_named() -> None:
    with pytest.raises(ConfigError, match="FLEETLINE_S3_SECURE must be true or false"):
        Settings.from_env({"FLEETLINE_S3_SECURE": "maybe"})
    with pytest.raises(ConfigError, match="FLEETLINE_KAFKA_BOOTSTRAP must be host:port"):
        LocalServices.from_settings(Settings.from_env({"FLEETLINE_KAFKA_BOOTSTRAP": "nohost"}))


def test_security_settings_come_from_the_environment(tmp_path) -> None:
    settings = Settings.from_env(
        {
            "FLEETLINE_AUTH_CONFIG": str(tmp_path / "auth.yaml"),
            "FLEETLINE_AUDIT_SIGNING_KEY": str(tmp_path / "k.pem"),
            "FLEETLINE_AUDIT_VERIFY_KEYS": f"{tmp_path / 'a.pem'},{tmp_path / 'b.pem'}",
            "FLEETLINE_OBJECT_ENCRYPTION_KEY": "c2VjcmV0",
            "FLEETLINE_CACHE_DIR": str(tmp_path),
        }
    )
    assert settings.auth_config == tmp_path / "auth.yaml"
    assert settings.signing_key_path() == tmp_path / "k.pem"
    assert settings.audit_verify_keys == (tmp_path / "a.pem", tmp_path / "b.pem")
    assert settings.object_encryption_key == "c2VjcmV0"
    assert (
        Settings.from_env({"FLEETLINE_CACHE_DIR": str(tmp_path)}).signing_key_path()
        == tmp_path / "audit" / "signing-key.pem"
    )
