"""The pure command decision (no services)."""

from __future__ import annotations

import pytest

from fleetline.agents.commands import ControlStore, NodeControl, apply_command


def cmd(kind: str, command_id: str = "c1", **fields) -> dict:
    return {
        "command_id": command_id,
        "kind": kind,
        "power_cap_w": None,
        "config_version": None,
        "config": {},
        **fields,
    }


def test_drain_cordon_uncordon() -> None:
    drained = apply_command(NodeControl(), cmd("DRAIN"))
    assert (drained.outcome, drained.control.state) == ("APPLIED", "DRAINING")
    cordoned = apply_command(drained.control, cmd("CORDON", "c2")).control
    assert cordoned.cordoned and cordoned.state == "DRAINING"
    assert not apply_command(cordoned, cmd("UNCORDON", "c3")).control.cordoned


def test_a_command_id_is_applied_once() -> None:
    first = apply_command(NodeControl(), cmd("CORDON"))
    again = apply_command(first.control, cmd("UNCORDON"))  # same id, different content
    assert again.outcome == "DUPLICATE" and again.control is first.control


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        (cmd("SET_POWER_CAP"), "power_cap_w must be 100-1000 W, got None"),
        (cmd("SET_POWER_CAP", power_cap_w=50.0), "got 50.0"),
        (cmd("APPLY_CONFIG"), "needs a config_version"),
        (cmd("APPLY_CONFIG", config_version="v2", config={"speed": "fast"}), "unknown settings"),
        (cmd("APPLY_CONFIG", config_version="v2", config={"interval_ms": "5"}), "100-60000"),
        (cmd("APPLY_CONFIG", config_version="v2", config={"interval_ms": "abc"}), "integer"),
        (cmd("UNKNOWN"), "does not know command UNKNOWN"),
    ],
)
def test_bad_commands_are_rejected_with_the_reason(command: dict, reason: str) -> None:
    decision = apply_command(NodeControl(), command)
    assert decision.outcome == "REJECTED"
    assert reason in decision.message
    assert decision.control == NodeControl()  # nothing changed, and the id is not spent


def test_power_cap_and_config() -> None:
    capped = apply_command(NodeControl(), cmd("SET_POWER_CAP", power_cap_w=450.0)).control
    assert capped.power_cap_w == 450.0
    configured = apply_command(
        capped, cmd("APPLY_CONFIG", "c2", config_version="v3", config={"interval_ms": "5000"})
    ).control
    assert (configured.config_version, configured.interval_ms) == ("v3", 5000)
    assert configured.applied == ("c1", "c2")


def test_control_state_survives_a_restart(tmp_path) -> None:
    store = ControlStore(tmp_path / "controls.json")
    store.put("n1", apply_command(NodeControl(), cmd("CORDON")).control)
    reloaded = ControlStore(tmp_path / "controls.json").get("n1")
    assert reloaded.cordoned and reloaded.applied == ("c1",)
    assert ControlStore(tmp_path / "controls.json").get("n2") == NodeControl()
