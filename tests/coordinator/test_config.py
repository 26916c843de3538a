"""Coordinator settings: TOML file, flag overrides, validation, participants."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from coordinator.__main__ import build_parser, config_from_args
from coordinator.config import participants
from coordinator.context import resolve_server_device
from coordinator.errors import ConfigError
from coordinator.runtime import build_models

TOML = """
fleet = "lab"
strategy = "fedavg_oca"
rounds = 7
participation = 0.5

[training]
local_epochs = 2
lr = 0.02

[broker]
url = "mqtt://broker.example:1883"
username = "coord"
"""


def parse(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_toml_file_gives_every_setting(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(TOML)

    config = parse("--config", str(path))

    assert (config.fleet, config.strategy, config.rounds, config.participation) == (
        "lab",
        "fedavg_oca",
        7,
        0.5,
    )
    assert config.training.local_epochs == 2 and config.training.lr == pytest.approx(0.02)
    assert config.training.batch_size is None  # left to the strategy (32 for fedavg_oca)
    assert config.broker is not None and config.broker.url == "mqtt://broker.example:1883"
    mqtt = config.broker.mqtt_config(config.broker.url, "cid")
    assert (mqtt.host, mqtt.port, mqtt.username) == ("broker.example", 1883, "coord")


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(TOML)

    config = parse("--config", str(path), "--rounds", "3", "--lr", "0.5", "--embedded-broker")

    assert config.rounds == 3 and config.training.lr == 0.5 and config.training.local_epochs == 2
    assert config.broker is not None and config.broker.embedded and config.broker.url is None


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--embedded-broker", "--participation", "0"], "participation"),
        (["--embedded-broker", "--rounds", "0"], "rounds"),
        (["--embedded-broker", "--local-epochs", "0"], "local_epochs and local_steps"),
        (["--embedded-broker", "--resume"], "resume needs a state_dir"),
        (["--rounds", "2"], "--broker URL or --embedded-broker"),
        (["--embedded-broker", "--model", "lenet5,vgg"], "unknown classifier 'vgg'"),
        (["--embedded-broker", "--model", "mlp,lenet5,mlp"], "names an architecture twice"),
    ],
)
def test_invalid_settings_raise_config_error(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse(*argv)


def test_unknown_key_in_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("roundz = 3\n[broker]\nembedded = true\n")

    with pytest.raises(ConfigError, match="roundz"):
        parse("--config", str(path))


def test_bad_toml_is_a_usage_error_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("rounds = [")

    result = subprocess.run(
        [sys.executable, "-m", "coordinator", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert result.returncode == 2
    assert "not valid TOML" in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("c", "registered", "online", "expected"),
    [
        (0.2, 20, 20, 4),
        (0.01, 20, 20, 1),
        (0.5, 10, 3, 3),
        (1.0, 5, 5, 5),
        (0.25, 10, 10, 3),
        (0.3, 5, 0, 0),
    ],
)
def test_participants(c: float, registered: int, online: int, expected: int) -> None:
    assert participants(c, registered, online) == expected


def test_mode_flags_reach_the_config() -> None:
    kf = parse(
        "--embedded-broker",
        "--strategy",
        "fedkf",
        "--downlink",
        "single",
        "--final-model",
        "aca",
        "--gamma",
        "0.5",
        "--lambda1",
        "0.2",
        "--lambda2",
        "0.3",
    )
    gen = parse("--embedded-broker", "--strategy", "fedgen", "--sharing", "head")

    assert (kf.strategy, kf.downlink, kf.final_model) == ("fedkf", "single", "aca")
    assert (kf.training.gamma, kf.training.lambda1, kf.training.lambda2) == (0.5, 0.2, 0.3)
    assert (gen.strategy, gen.sharing) == ("fedgen", "head")
    assert "sharing" in gen.fingerprint_fields() and "downlink" in kf.fingerprint_fields()


def test_precision_flags_reach_the_config() -> None:
    both = parse("--embedded-broker", "--precision", "int8")
    mixed = parse(
        "--embedded-broker",
        "--precision",
        "int8",
        "--uplink-precision",
        "int4",
        "--no-downlink-deltas",
        "--teacher-budget",
        "0.2",
        "--qat",
    )
    plain = parse("--embedded-broker")

    assert (both.downlink_precision, both.uplink_precision) == ("int8", "int8")
    assert (mixed.downlink_precision, mixed.uplink_precision) == ("int8", "int4")
    assert not mixed.downlink_deltas and mixed.teacher_budget == 0.2 and mixed.training.qat
    assert (plain.downlink_precision, plain.uplink_precision) == ("fp32", "fp32")
    assert plain.downlink_deltas and not plain.training.qat


def test_flags_left_out_are_not_given_so_the_file_keeps_its_values(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(TOML.replace("lr = 0.02", "lr = 0.02\nmomentum = 0.5"))

    config = parse("--config", str(path), "--no-downlink-deltas", "--weight-decay", "0.001")

    assert config.training.momentum == 0.5 and config.training.lr == pytest.approx(0.02)
    assert config.training.weight_decay == 0.001 and not config.downlink_deltas
    assert config.rounds == 7 and config.export_onnx  # neither given: the file, the default


def test_help_shows_every_setting_with_its_model_default() -> None:
    text = build_parser().format_help()

    for flag in ("--broker URL", "--embedded-broker", "--round-timeout", "--no-onnx", "--resume"):
        assert flag in text
    assert "--momentum MOMENTUM" in text and "(default: 0.9)" in text
    assert "--weight-decay" in text and "--generative-alpha-decay" in text


def test_resume_without_a_saved_run_says_it_starts_fresh(tmp_path: Path) -> None:
    missing = tmp_path / "state"
    argv = ["--broker", "mqtt://127.0.0.1:1", "--state-dir", str(missing), "--resume"]
    argv += ["--connect-retry", "0"]  # nothing listens: exit at the first failure
    argv.append("--insecure-no-auth")

    result = subprocess.run(
        [sys.executable, "-m", "coordinator", *argv],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert f"WARNING coordinator: no saved run in {missing}: starting a fresh run" in result.stderr
    assert result.returncode == 1  # then the broker is refused: a runtime failure


def test_server_device_flag_reaches_the_config_and_resolves() -> None:
    chosen = parse("--embedded-broker", "--server-device", "cpu")
    plain = parse("--embedded-broker")

    assert chosen.server_device == "cpu" and plain.server_device == "auto"
    assert "--server-device {auto,cpu,cuda}" in build_parser().format_help()
    assert resolve_server_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_server_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no usable GPU"):
            resolve_server_device("cuda")
    with pytest.raises(SystemExit):
        parse("--embedded-broker", "--server-device", "tpu")


def test_a_model_list_gives_the_coordinator_one_group_per_architecture() -> None:
    config = parse("--embedded-broker", "--model", "lenet5, mlp")

    templates = build_models(config)

    assert config.model == "lenet5,mlp" and config.architectures == ("lenet5", "mlp")
    assert {name: t.architecture for name, t in templates.items()} == {
        "lenet5": "lenet5",
        "mlp": "mlp",
    }
    assert "--model MODEL[,MODEL...]" in build_parser().format_help()


def test_a_taken_embedded_broker_port_is_one_line_naming_the_flags() -> None:
    # Prepare: another broker's socket on the port asked for (an installed Mosquitto on 1883)
    with socket.create_server(("127.0.0.1", 0)) as squatter:
        port = squatter.getsockname()[1]
        argv = ["--embedded-broker", "--embedded-port", str(port), "--insecure-no-auth"]

        # Execute
        result = subprocess.run(
            [sys.executable, "-m", "coordinator", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )

    # Assert: a runtime failure, one error line saying what to do, no traceback
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert errors == [
        f"python -m coordinator: error: port {port} on 127.0.0.1 is taken (another MQTT broker, "
        "such as an installed Mosquitto?): pass --embedded-port 0 for a free one (its URL is "
        "logged at start), or --broker mqtt://HOST:PORT to use that broker"
    ]
