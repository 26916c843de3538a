"""``python -m sim``'s command line: help, settings from flags, one-line failures."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from coordinator.config import FleetSettings
from sim.__main__ import build_parser, main
from sim.run import SimConfig
from sim.run_cli import EMBEDDED_BROKER_DEVICES, embedded_broker_note, sim_config


def run_sim(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sim", *argv], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("argv", [["--help"], ["-h"], ["run", "--help"]])
def test_help_shows_the_run_flags_grouped_then_the_other_commands(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)

    text = capsys.readouterr().out
    assert exited.value.code == 0
    assert text.startswith("usage: python -m sim run")
    headings = ["fleet:", "training (sent to the devices):", "data:", "transport:", "outputs:"]
    positions = [text.index(f"\n{h}\n") for h in headings]
    assert positions == sorted(positions)
    for flag in ("--devices", "--strategy", "--lr", "--momentum", "--dataset", "--broker URL"):
        assert flag in text
    assert "(default: 0.9)" in text and "(default: 50)" in text
    assert text.index("other commands") > positions[-1]
    assert "partition" in text and "budget" in text


def test_flags_left_out_take_the_models_defaults() -> None:
    args = build_parser().parse_args(["run", "--rounds", "3", "--lr", "0.1", "--precision", "int8"])

    config = sim_config(args)

    assert config.rounds == 3 and config.training.lr == 0.1
    assert (config.downlink_precision.value, config.uplink_precision.value) == ("int8", "int8")
    assert config.training.momentum == SimConfig().training.momentum == 0.9
    assert config.devices == SimConfig.model_fields["devices"].default


def test_sim_config_holds_the_coordinators_fleet_settings() -> None:
    config = SimConfig(strategy="fedkf", rounds=2, devices=3, teacher_budget=0.5)

    coordinator = config.coordinator_config(10, (1, 28, 28))

    for name in FleetSettings.model_fields:
        assert getattr(coordinator, name) == getattr(config, name), name
    assert (coordinator.fleet, coordinator.min_devices, coordinator.export_onnx) == (
        "sim",
        3,
        False,
    )


def _refused_port() -> int:
    with socket.socket() as probe:  # bound, never listening: connections are refused
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_refused_broker_is_one_line_and_exit_1_at_once() -> None:
    port = _refused_port()
    start = time.monotonic()

    result = run_sim("--broker", f"mqtt://127.0.0.1:{port}", "--devices", "2", "--rounds", "1")

    elapsed = time.monotonic() - start
    assert result.returncode == 1
    assert result.stderr == (
        f"python -m sim run: error: cannot reach the MQTT broker at 127.0.0.1:{port}: "
        "connection refused\n"
    )
    assert elapsed < 30  # no minute of connection retries (most of this is imports)


def test_an_iid_run_writes_a_strict_json_report(tmp_path: Path) -> None:
    # Execute: alpha inf, the documented IID setting, with a JSON report.
    out = tmp_path / "run.json"
    argv = ["--alpha", "inf", "--devices", "4", "--rounds", "1", "--participation", "1"]
    proc = run_sim(*argv, "--local-steps", "1", "--transport", "inproc", "--json-out", str(out))

    # Assert: JSON has no infinity, so the report says "inf"; it reads back.
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text(), parse_constant=pytest.fail)
    assert report["config"]["alpha"] == "inf"
    assert SimConfig(**report["config"]).alpha == math.inf


def test_a_missing_dataset_is_one_line_naming_the_flags(tmp_path: Path) -> None:
    proc = run_sim("--dataset", "mnist", "--data-dir", str(tmp_path), "--transport", "inproc")

    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert errors[0].startswith("python -m sim run: error: mnist:")
    assert "--data-dir" in errors[0] and "--download" in errors[0]
    assert "download=True" not in errors[0]


def test_a_large_fleet_on_the_embedded_broker_gets_a_note_naming_the_alternatives() -> None:
    large = EMBEDDED_BROKER_DEVICES + 1

    note = embedded_broker_note(SimConfig(devices=large))

    assert note is not None and "--broker" in note and "--transport inproc" in note
    assert embedded_broker_note(SimConfig(devices=EMBEDDED_BROKER_DEVICES)) is None
    assert embedded_broker_note(SimConfig(devices=large, transport="inproc")) is None
    broker = SimConfig(devices=large, broker_url="mqtt://127.0.0.1:1883")
    assert embedded_broker_note(broker) is None
