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


def test_replication_comes_from_the_environment_or_the_cluster() -> None:
    defaults = Settings.from_env({}).kafka
    assert (defaults.replication_factor, defaults.min_insync_replicas) == (-1, None)
    kafka = Settings.from_env(
        {"FLEETLINE_KAFKA_REPLICATION": "3", "FLEETLINE_KAFKA_MIN_INSYNC": "2"}
    ).kafka
    assert (kafka.replication_factor, kafka.min_insync_replicas) == (3, 2)
    with pytest.raises(ConfigError, match="FLEETLINE_KAFKA_REPLICATION must be above 0"):
        Settings.from_env({"FLEETLINE_KAFKA_REPLICATION": "0"})


def test_a_consumer_session_is_librdkafka_s_unless_the_environment_shortens_it() -> None:
    assert Settings.from_env({}).kafka.session_timeout_ms is None
    shortened = Settings.from_env({"FLEETLINE_KAFKA_SESSION_TIMEOUT_MS": "10000"}).kafka
    assert shortened.session_timeout_ms == 10_000
    assert "session.timeout.ms" not in shortened.client_config()  # producers take none


def _properties(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines())


def test_three_local_brokers_form_one_quorum_and_replicate_three_times(tmp_path) -> None:
    env = {"FLEETLINE_CACHE_DIR": str(tmp_path), "FLEETLINE_KAFKA_BOOTSTRAP": "127.0.0.1:39092"}
    cluster = LocalServices.from_settings(Settings.from_env(env), brokers=3).kafka
    assert cluster.bootstrap_servers == "127.0.0.1:39092,127.0.0.1:39094,127.0.0.1:39096"
    props = [_properties(b.server_properties()) for b in cluster.brokers]
    assert [p["node.id"] for p in props] == ["1", "2", "3"]
    voters = "1@127.0.0.1:39093,2@127.0.0.1:39095,3@127.0.0.1:39097"
    assert all(p["controller.quorum.voters"] == voters for p in props)
    for p in props:
        assert p["default.replication.factor"] == p["offsets.topic.replication.factor"] == "3"
        assert p["min.insync.replicas"] == p["transaction.state.log.min.isr"] == "2"
        assert p["unclean.leader.election.enable"] == "false"
    # The bootstrap list names the brokers just as well, and must match their ports.
    listed = {**env, "FLEETLINE_KAFKA_BOOTSTRAP": cluster.bootstrap_servers}
    assert len(LocalServices.from_settings(Settings.from_env(listed)).kafka.brokers) == 3
    skewed = {**env, "FLEETLINE_KAFKA_BOOTSTRAP": "127.0.0.1:39092,127.0.0.1:39093"}
    with pytest.raises(ConfigError, match="each next broker two ports up"):
        LocalServices.from_settings(Settings.from_env(skewed))
    alone = _properties(
        LocalServices.from_settings(Settings.from_env(env)).kafka.first.server_properties()
    )
    assert alone["controller.quorum.voters"] == "1@127.0.0.1:39093"
    assert alone["default.replication.factor"] == alone["min.insync.replicas"] == "1"


def test_a_command_seals_with_the_deployment_key_only_where_one_was_made(tmp_path) -> None:
    settings = Settings.from_env({"FLEETLINE_CACHE_DIR": str(tmp_path)})
    assert settings.with_deployment_key(create=False).object_encryption_key is None
    assert not settings.deployment_key_path().exists()
    made = settings.with_deployment_key()
    assert made.object_key() is not None and len(made.object_key() or b"") == 32
    assert settings.deployment_key_path().stat().st_mode & 0o777 == 0o600
    adopted = settings.with_deployment_key(create=False)
    assert adopted.object_encryption_key == made.object_encryption_key
    given = Settings.from_env(
        {"FLEETLINE_CACHE_DIR": str(tmp_path), "FLEETLINE_OBJECT_ENCRYPTION_KEY": "c2VjcmV0"}
    )
    assert given.with_deployment_key().object_encryption_key == "c2VjcmV0"
