"""docs/config.md (generated from the settings' models) and ``python -m sim --config``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.config import load_config
from coordinator.errors import ConfigError
from sim.__main__ import build_parser, main
from sim.config_docs import COORDINATOR_EXAMPLE, DOC, SIM_EXAMPLE, render
from sim.errors import SimError
from sim.run_cli import load_sim_config, sim_config


def test_docs_config_md_is_what_the_models_give_now() -> None:
    assert DOC.read_text() == render(), "run python -m sim.config_docs"


def test_the_examples_of_the_doc_load(tmp_path: Path) -> None:
    text = DOC.read_text()
    assert "```toml\n" + COORDINATOR_EXAMPLE + "```" in text
    assert "```toml\n" + SIM_EXAMPLE + "```" in text
    coordinator_file = tmp_path / "coordinator.toml"
    coordinator_file.write_text(COORDINATOR_EXAMPLE)
    sim_file = tmp_path / "sim.toml"
    sim_file.write_text(SIM_EXAMPLE)

    coordinator = load_config(coordinator_file)
    sim = load_sim_config(sim_file)

    assert coordinator.rounds == 20 and coordinator.training.lr == 0.01
    assert coordinator.broker is not None and coordinator.broker.url is not None
    assert sim.devices == 20 and sim.strategy == "fedkf" and sim.training.local_steps == 2


def test_a_misplaced_coordinator_key_says_where_it_belongs(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("lr = 0.1\n[training]\nrounds = 2\n")

    with pytest.raises(ConfigError) as caught:
        load_config(path)

    message = str(caught.value)
    assert "training.rounds: rounds is a top-level key, not a [training] one" in message
    assert "lr: lr is a [training] key, not a top-level one" in message


def _args(*tokens: str) -> object:
    return build_parser().parse_args(["run", *tokens])


def test_flags_given_win_over_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sim.toml"
    path.write_text('devices = 6\nrounds = 3\nstrategy = "fedprox"\n[training]\nlocal_steps = 4\n')

    config = sim_config(_args("--config", str(path), "--rounds", "2", "--batch-size", "8"))  # type: ignore[arg-type]

    assert (config.devices, config.rounds, config.strategy) == (6, 2, "fedprox")
    assert (config.training.local_steps, config.training.batch_size) == (4, 8)


def test_an_unknown_or_misplaced_key_exits_2_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sim.toml"
    path.write_text("devices = 4\nbogus = 1\n[training]\nrounds = 2\n")

    code = main(["--config", str(path)])

    err = capsys.readouterr().err
    assert code == 2
    assert f"invalid settings in {path}" in err
    assert "bogus: unknown key" in err
    assert "training.rounds: rounds is a top-level key, not a [training] one" in err


def test_a_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(SimError, match="cannot read config file"):
        load_sim_config(tmp_path / "absent.toml")


def test_a_file_configured_run_reports_the_config_of_the_flags_configured_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "sim.toml"
    path.write_text(
        'devices = 2\nrounds = 1\nparticipation = 1.0\ntransport = "inproc"\n'
        "samples_per_device = 20\n[training]\nlocal_steps = 1\nbatch_size = 8\n"
    )
    flags = [
        *("--devices", "2", "--rounds", "1", "--participation", "1.0"),
        *("--transport", "inproc", "--samples-per-device", "20"),
        *("--local-steps", "1", "--batch-size", "8"),
    ]

    assert main(["--config", str(path), "--json-out", str(tmp_path / "file.json")]) == 0
    assert main([*flags, "--json-out", str(tmp_path / "flags.json")]) == 0

    from_file = json.loads((tmp_path / "file.json").read_text())["config"]
    from_flags = json.loads((tmp_path / "flags.json").read_text())["config"]
    assert from_file == from_flags
    assert from_file["devices"] == 2 and from_file["training"]["local_steps"] == 1
