"""`python -m sim budget`: byte figures from the real engine and encoders, no fleet run."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from coordinator.config import TrainingSettings
from sim.__main__ import main
from sim.budget import (
    LINK_PROFILES,
    Bytes,
    budget_engine,
    estimate,
    estimate_with_reference,
    link_profile,
    reference_config,
    transfer_time,
)
from sim.errors import SimError
from sim.run import SimConfig, run_simulation

TINY = TrainingSettings(local_steps=2, batch_size=16)
# 4 devices, half of them per round, 4 rounds: 8 device-rounds, so devices are selected
# more than once and get downlink deltas against the model they hold
FLEET: dict[str, Any] = {
    "devices": 4,
    "participation": 0.5,
    "rounds": 4,
    "model": "lenet5",
    "dataset": "synthetic",
    "training": TINY,
}
FIELDS = ("up", "down", "wire_up", "wire_down")


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small(**overrides: Any) -> SimConfig:
    return SimConfig(**{**FLEET, **overrides})


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse exits itself on parse errors
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


QUICK_CLI = ["budget", "--devices", "4", "--participation", "0.5", "--rounds", "2",
             "--local-steps", "1"]  # fmt: skip


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({}, id="fedavg-fp32"),
        pytest.param({"downlink_precision": "int8", "uplink_precision": "int8"}, id="fedavg-int8"),
        pytest.param({"downlink_precision": "int4", "uplink_precision": "int4"}, id="fedavg-int4"),
        pytest.param(
            {"strategy": "fedkf", "downlink_precision": "int8", "uplink_precision": "int8"},
            id="fedkf-dual-int8",
        ),
    ],
)
def test_budget_equals_the_bytes_a_sim_run_counts(settings: dict[str, Any]) -> None:
    config = small(transport="inproc", **settings)

    budget = estimate(config)
    for _ in range(2):
        # On a loaded machine a sim device may handle the coordinator's "starting" late
        # and say hello again after round 1 started; if it is selected, the coordinator
        # sends it its model a second time. One more run is then enough.
        counted = sim_totals(run_simulation(config).final)
        if all(budget.total.to_dict()[f] == pytest.approx(counted[f], rel=0.01) for f in FIELDS):
            break

    assert budget.device_rounds == 8 > config.devices  # some devices more than once
    for field in FIELDS:
        assert budget.total.to_dict()[field] == pytest.approx(counted[field], rel=0.01), field


@pytest.mark.parametrize("strategy", ["fedavg", "fedkf"])
def test_the_batched_engine_and_the_loop_give_the_same_budget(strategy: str) -> None:
    settings = {"strategy": strategy, "downlink_precision": "int8", "uplink_precision": "int4"}
    batched = estimate(small(rounds=2, engine="batched", max_cohort=3, **settings))
    loop = estimate(small(rounds=2, engine="loop", **settings))

    assert batched.device_rounds == loop.device_rounds
    for field in FIELDS:  # lossy deltas of (nearly) the same weights
        assert getattr(batched.total, field) == pytest.approx(getattr(loop.total, field), rel=1e-3)


def test_the_budgets_auto_engine_is_the_batched_one_on_any_device() -> None:
    # a run's auto is the loop on a CPU (its wire needs the cores); the budget has no wire
    assert budget_engine("auto") == "batched"
    assert budget_engine("loop") == "loop"
    assert budget_engine("batched") == "batched"


def sim_totals(final: dict[str, Any]) -> dict[str, int]:
    """A sim report's four byte totals under the budget's names."""
    return {
        "up": final["bytes_up"],
        "down": final["bytes_down"],
        "wire_up": final["wire_bytes_up"],
        "wire_down": final["wire_bytes_down"],
    }


def test_the_reference_is_estimated_on_the_budgets_own_data() -> None:
    # Prepare: an int8 FedKF budget, whose reference is fp32 FedAvg
    config = small(strategy="fedkf", downlink_precision="int8", uplink_precision="int8")
    settings = reference_config(config)

    # Execute
    budget, reference = estimate_with_reference(config)
    alone = estimate(settings)
    same_budget, same_reference = estimate_with_reference(settings)

    # Assert: the reference is that of its own settings, and counts what a separate
    # estimate of them counts (message ids and timings compress a few bytes apart); a
    # budget of the reference settings is its own reference
    assert budget.config == config and reference.config == settings
    assert reference.device_rounds == alone.device_rounds == budget.device_rounds
    assert set(reference.by_kind) == set(alone.by_kind)
    for field in FIELDS:
        expected = getattr(alone.total, field)
        assert math.isclose(getattr(reference.total, field), expected, rel_tol=0.01)
    assert same_budget is same_reference


def test_counts_add_up_and_name_every_message_kind() -> None:
    budget = estimate(small(downlink_precision="int8", uplink_precision="int8"))

    total = sum(budget.by_kind.values(), Bytes())
    assert total == budget.total
    assert set(budget.by_kind) == {
        "hello", "device_status", "coord_status", "ack", "model", "task", "update",
    }  # fmt: skip
    assert budget.by_kind["update"].down == 0 and budget.by_kind["model"].up == 0
    per = budget.per_device_round
    assert per.up * budget.device_rounds <= budget.total.up
    assert per.wire_up > per.up and per.wire_down > per.down
    assert budget.per_round == budget.total.per(4)


def test_lower_precisions_move_fewer_bytes() -> None:
    totals = {
        precision: estimate(
            small(rounds=2, downlink_precision=precision, uplink_precision=precision)
        ).total
        for precision in ("int8", "fp16", "fp32")
    }

    for field in FIELDS:
        int8, fp16, fp32 = (getattr(totals[p], field) for p in ("int8", "fp16", "fp32"))
        assert int8 < fp16 < fp32, field


def test_reference_is_fp32_fedavg_with_full_sharing() -> None:
    config = small(strategy="fedgen", sharing="head", downlink_precision="int4")

    reference = reference_config(config)

    assert (reference.strategy, reference.sharing) == ("fedavg", "full")
    assert reference.downlink_precision.value == reference.uplink_precision.value == "fp32"
    assert (reference.devices, reference.rounds, reference.participation) == (4, 4, 0.5)
    assert reference.model == config.model and reference.seed == config.seed


def test_json_has_the_documented_keys_and_the_fp32_fedavg_reference(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli([*QUICK_CLI, "--precision", "int8", "--link", "64k", "--json"], capsys)
    quantized = json.loads(out)
    code_ref, out_ref, _ = run_cli([*QUICK_CLI, "--json"], capsys)
    fp32 = json.loads(out_ref)

    assert code == code_ref == 0
    for data in (quantized, quantized["reference"], fp32, fp32["reference"]):
        for scope in ("per_device_round", "per_round", "total"):
            assert set(data[scope]) == set(FIELDS)
            assert all(isinstance(v, int) and v > 0 for v in data[scope].values())
    assert quantized["config"]["downlink_precision"] == "int8"
    assert quantized["link"] == {"name": "64k", "up_bps": 64e3, "down_bps": 64e3, "latency_s": 0.0}
    assert set(quantized["seconds_per_device_round"]) == {"up", "down", "total"}
    assert "seconds_per_device_round" in quantized["reference"]
    assert "link" not in fp32
    # an fp32 FedAvg configuration is its own reference ...
    for scope in ("per_device_round", "per_round", "total"):
        assert fp32["reference"][scope] == fp32[scope]
    # ... and the same figures as the reference of a quantized configuration (only the
    # random message ids and measured timings compress differently)
    for scope in ("per_device_round", "total"):
        for field in FIELDS:
            assert quantized["reference"][scope][field] == pytest.approx(
                fp32[scope][field], rel=1e-3
            )
    assert quantized["ratio"]["up"] == pytest.approx(
        quantized["total"]["up"] / quantized["reference"]["total"]["up"], rel=1e-3
    )


def test_numeric_link_time_is_wire_bytes_at_the_rate(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli([*QUICK_CLI, "--precision", "int8", "--link", "250k", "--json"], capsys)
    data = json.loads(out)

    per = data["per_device_round"]
    seconds = data["seconds_per_device_round"]
    assert code == 0
    assert seconds["up"] == pytest.approx(per["wire_up"] * 8 / 250e3)
    assert seconds["down"] == pytest.approx(per["wire_down"] * 8 / 250e3)
    assert seconds["total"] == pytest.approx(seconds["up"] + seconds["down"])


def test_link_time_adds_the_latency_once_per_direction() -> None:
    counts = Bytes(up=900, down=1900, wire_up=1000, wire_down=2000)

    numeric = transfer_time(counts, link_profile("8000"))
    nb_iot = transfer_time(counts, link_profile("NB-IoT"))

    assert (numeric.up, numeric.down, numeric.total) == (1.0, 2.0, 3.0)
    profile = LINK_PROFILES["nb-iot"]
    assert nb_iot.up == pytest.approx(8000 / profile.up_bps + profile.latency_s)
    assert nb_iot.down == pytest.approx(16000 / profile.down_bps + profile.latency_s)
    assert transfer_time(Bytes(), profile).total == 0.0


@pytest.mark.parametrize(
    ("text", "name", "up_bps"),
    [
        ("nb-iot", "nb-iot", LINK_PROFILES["nb-iot"].up_bps),
        ("LTE-M", "lte-m", LINK_PROFILES["lte-m"].up_bps),
        ("lte", "4g", LINK_PROFILES["4g"].up_bps),
        ("Wi-Fi", "wifi", LINK_PROFILES["wifi"].up_bps),
        ("3g", "3g", LINK_PROFILES["3g"].up_bps),
        ("3G", "3g", LINK_PROFILES["3g"].up_bps),
        ("UMTS", "3g", LINK_PROFILES["3g"].up_bps),
        ("4g", "4g", LINK_PROFILES["4g"].up_bps),
        ("4G", "4g", LINK_PROFILES["4g"].up_bps),
        ("5g", "5g", LINK_PROFILES["5g"].up_bps),
        ("5G", "5g", LINK_PROFILES["5g"].up_bps),
        ("250k", "250k", 250e3),
        ("1.5M", "1.5M", 1.5e6),
        ("2e6", "2e6", 2e6),
        ("250kbit/s", "250kbit/s", 250e3),
        ("8Mbps", "8Mbps", 8e6),
        ("3Gbit/s", "3Gbit/s", 3e9),
        ("3Gbps", "3Gbps", 3e9),
        ("3gbit", "3gbit", 3e9),
        ("1.5 Gb/s", "1.5 Gb/s", 1.5e9),
    ],
)
def test_link_names_and_rates(text: str, name: str, up_bps: float) -> None:
    profile = link_profile(text)

    assert (profile.name, profile.up_bps) == (name, up_bps)


def test_3g_is_a_profile_not_3_gbit_per_s(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli([*QUICK_CLI, "--link", "3G", "--json"], capsys)

    assert code == 0
    assert json.loads(out)["link"] == {
        "name": "3g",
        "up_bps": 1e6,
        "down_bps": 3e6,
        "latency_s": 0.1,
    }
    assert list(LINK_PROFILES) == ["nb-iot", "lte-m", "3g", "4g", "5g", "wifi"]


@pytest.mark.parametrize("text", ["lora", "0", "-5", "fast", "inf", ""])
def test_bad_links_are_refused(text: str) -> None:
    with pytest.raises(SimError, match="unknown link"):
        link_profile(text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("2g", "a bare G names a mobile generation, not Gbit/s: 2Gbit/s is a rate"),
        ("6G", "a bare G names a mobile generation, not Gbit/s: 6Gbit/s is a rate"),
        ("1.5g", "1.5Gbit/s is a rate"),
        ("1MB/s", "bytes per second: give bits"),
        ("1MBps", "bytes per second: give bits"),
    ],
)
def test_ambiguous_rates_are_refused_with_the_profiles_and_the_rate_syntax(
    text: str, why: str
) -> None:
    with pytest.raises(SimError) as raised:
        link_profile(text)

    message = str(raised.value)
    assert message.startswith(f"unknown link {text!r}") and why in message
    assert "nb-iot, lte-m, 3g, 4g, 5g, wifi" in message
    assert "2Gbit/s, 2Gbps" in message and "\n" not in message


def test_table_shows_config_reference_ratio_and_link_times(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli([*QUICK_CLI, "--precision", "int8", "--link", "4g"], capsys)

    assert code == 0 and err == ""
    lines = out.splitlines()
    assert "fedavg int8" in lines[2] and "fedavg fp32" in lines[2] and "ratio" in lines[2]
    for label in ("per device-round", "per round", "whole run", "s/device-round", "link 4g"):
        assert any(line.startswith(label) for line in lines), label
    ratios = [float(line.split()[-1]) for line in lines[3:15]]
    assert all(0 < r < 1 for r in ratios)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["budget", "--model", "nope"], "unknown classifier 'nope'"),
        (["budget", "--strategy", "nope"], "invalid choice"),
        (["budget", "--precision", "int3"], "invalid choice"),
        (["budget", "--uplink-precision", "fp64"], "invalid choice"),
        ([*QUICK_CLI, "--strategy", "fedkf", "--sharing", "head"], "does not support sharing"),
        ([*QUICK_CLI, "--link", "carrier-pigeon"], "unknown link"),
        ([*QUICK_CLI, "--link", "2g"], "2Gbit/s is a rate"),
        ([*QUICK_CLI, "--devices", "0"], "devices"),
        ([*QUICK_CLI, "--device-precisions", "int8,int2"], "invalid settings"),
    ],
)
def test_bad_input_is_one_line_on_stderr_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(argv, capsys)

    assert code == 2 and out == ""
    assert err.count("\n") == 1 and expected in err


def test_infinite_alpha_is_json_safe(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli([*QUICK_CLI, "--alpha", "inf", "--json"], capsys)

    assert code == 0 and json.loads(out)["config"]["alpha"] == "inf"
    assert not math.isnan(json.loads(out)["ratio"]["up"])


def test_feddf_needs_proxy_data_and_is_refused_in_one_line_without_it() -> None:
    with pytest.raises(SimError, match="'feddf' distils on the server's proxy data"):
        estimate(small(strategy="feddf"))
