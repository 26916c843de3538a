"""The device's settings (edge_client.config): its configuration file and ``--config``
on the CLI."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_client.__main__ import CONFIGURABLE, _build_parser, _device_settings, main
from edge_client.config import ClientConfig, DeviceSettings, load_device_file
from edge_client.errors import ConfigError
from edge_client.train.hello import device_hello
from protocol.flags import ModelFlags
from protocol.tensors import Precision
from protocol.transport.base import MqttVersion


@pytest.fixture(autouse=True)
def _root_handlers() -> Iterator[None]:
    """main() configures the root logger of this process; put it back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def write(tmp_path: Path, text: str, name: str = "edgefl.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def parse(arguments: list[str]) -> DeviceSettings:
    parser, _ = _build_parser()
    return _device_settings(parser.parse_args(arguments))


def test_every_flag_of_run_and_follow_is_a_key_and_every_key_a_flag() -> None:
    _, subparsers = _build_parser()
    keys: set[str] = set()
    for command in CONFIGURABLE:
        flags: ModelFlags = subparsers[command].get_default("settings_flags")
        for action in subparsers[command]._actions:
            if action.dest not in ("help", "config"):
                keys.add(".".join(flags.dests[action.dest]))  # KeyError: a flag not a key
    assert keys == set(DeviceSettings.model_fields)


def test_file_values_become_the_flags_and_command_line_flags_win(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        'broker = "mqtt://10.0.0.5:1884"\nfleet = "lab"\ndevice_id = "pi-07"\n'
        'data = "data/dev.npz"\nthreads = 3\nprecision = "int8"\nshare_label_counts = true\n'
        'mqtt_version = "5"\nlog_format = "journald"\nmemory_budget_mb = 300\n',
    )
    args = parse(["run", "--config", str(config), "--threads", "2"])
    assert args.broker == "mqtt://10.0.0.5:1884" and args.fleet == "lab"
    assert args.device_id == "pi-07" and args.precision is Precision.INT8
    assert args.share_label_counts is True and args.mqtt_version is MqttVersion.V5
    assert args.log_format == "journald" and args.memory_budget_mb == 300
    assert args.threads == 2  # the flag wins
    assert args.data == tmp_path / "data" / "dev.npz"  # relative to the file's folder
    # without the flag, the file's value; without the key, the flag's default
    args = parse(["run", "--config", str(config)])
    assert args.threads == 3 and args.init_seed == 0 and args.model == "lenet5"


def test_one_file_serves_both_commands(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        'device_id = "cam-1"\ndata = "/d.npz"\nserve_onnx = "m.onnx"\nonnx_template = "t.onnx"\n',
    )
    args = parse(["follow", "--config", str(config)])
    assert args.device_id == "cam-1" and args.data is None  # follow takes no data
    assert args.serve_onnx == tmp_path / "m.onnx" and args.onnx_template == tmp_path / "t.onnx"


def test_a_binary_device_says_so_in_its_hello(tmp_path: Path) -> None:
    config = write(tmp_path, 'device_id = "pi-07"\nweight_format = "binary"\n')
    args = parse(["run", "--config", str(config)])
    assert args.weight_format == "binary"
    assert parse(["run", "--device-id", "pi-07"]).weight_format == "float"

    hello = device_hello(
        ClientConfig(device_id="pi-07", weight_format=args.weight_format),
        fingerprint="0123456789abcdef",
        num_samples=10,
        held_base=None,
        memory_bytes=0,
    )

    assert hello.weight_format == "binary"


def test_a_precision_stays_typed_from_the_file_or_flag_to_the_hello(tmp_path: Path) -> None:
    config = write(tmp_path, 'device_id = "pi-07"\nprecision = "int8"\ninsecure_no_auth = true\n')
    settings = parse(["run", "--config", str(config), "--uplink-precision", "int4"])

    client = settings.client_config("pi-07")
    hello = device_hello(
        client, fingerprint="0123456789abcdef", num_samples=10, held_base=None, memory_bytes=0
    )

    assert client.downlink_precision is Precision.INT8  # --precision, both ways ...
    assert client.uplink_precision is Precision.INT4  # ... but the direction's own wins
    assert (hello.downlink_precision, hello.uplink_precision) == (Precision.INT8, Precision.INT4)


def test_a_bad_flag_is_named_as_the_flag_and_a_bad_key_as_the_key(tmp_path: Path) -> None:
    config = write(tmp_path, "threads = 0\n")

    with pytest.raises(ConfigError, match="--threads: "):
        parse(["run", "--threads", "0"])
    with pytest.raises(ConfigError, match=r"in .*edgefl.toml: threads: "):
        parse(["run", "--config", str(config)])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('password = "hunter2"\n', "no 'password' key"),
        ('devcie_id = "x"\n', "devcie_id"),
        ("threads = 0\n", "threads"),
        ('precision = "int3"\n', "precision"),
        ('weight_format = "ternary"\n', "weight_format"),
        ('mqtt_version = "4"\n', "mqtt_version"),
        ('password_env = "NOT A NAME"\n', "password_env"),
        ("[broker]\nurl = 'x'\n", "flat table"),
        ("threads = \n", "not valid TOML"),
    ],
)
def test_bad_files_are_refused_with_the_key_named(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        load_device_file(write(tmp_path, text))


def test_a_missing_or_huge_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_device_file(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="larger than"):
        load_device_file(write(tmp_path, "# " + "x" * (1 << 20) + "\n"))


def test_cli_errors_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = write(tmp_path, 'password = "x"\n')
    assert main(["run", "--config", str(bad)]) == 2
    assert "no 'password' key" in capsys.readouterr().err
    empty = write(tmp_path, 'device_id = "a"\n', "empty.toml")
    assert main(["run", "--config", str(empty)]) == 2
    assert "--data (or data in the config file) is required" in capsys.readouterr().err
    assert main(["follow", "--config", str(empty)]) == 2
    assert "--serve-onnx and --onnx-template" in capsys.readouterr().err


def test_the_password_comes_from_the_named_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PI_SECRET", "s3cret")
    config = write(tmp_path, 'device_id = "pi-1"\nusername = "pi-1"\npassword_env = "PI_SECRET"\n')
    args = parse(["run", "--config", str(config)])
    client = args.client_config("pi-1")
    assert client.broker.password is not None
    assert client.broker.password.get_secret_value() == "s3cret"
    secret = tmp_path / "pw"
    secret.write_text("from-file\n", encoding="utf-8")
    args = parse(["run", "--config", str(config), "--password-file", str(secret)])
    password = args.client_config("pi-1").broker.password
    assert password is not None and password.get_secret_value() == "from-file"


def test_a_fleet_token_gives_the_device_its_derived_key_and_excludes_a_key_file(
    tmp_path: Path,
) -> None:
    from protocol.auth import derive_device_key, new_key, write_fleet_token, write_key_file

    token = new_key()
    write_fleet_token(tmp_path / "fleet.token", token)
    write_key_file(tmp_path / "pi-1.key", new_key())
    (tmp_path / "bad.token").write_text("short\n")
    config = write(tmp_path, 'device_id = "pi-1"\nfleet_token_file = "fleet.token"\n')

    client = parse(["run", "--config", str(config)]).client_config("pi-1")
    both = parse(["run", "--config", str(config), "--auth-key-file", str(tmp_path / "pi-1.key")])
    bad = parse(["run", "--fleet-token-file", str(tmp_path / "bad.token")])

    keyring = client.keyring()
    assert keyring is not None and dict(keyring) == {"pi-1": derive_device_key(token, "pi-1")}
    with pytest.raises(ConfigError, match="not both"):
        both.client_config("pi-1")
    with pytest.raises(ConfigError, match="fleet token file"):
        bad.client_config("pi-1")
