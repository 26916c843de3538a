"""A fleet of float, int8 and binary devices fused by FedDF, end to end in process."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from coordinator.state import RunState
from coordinator.store import FileStore
from sim.run import DeviceLink, SimConfig, parse_device, run_simulation
from tests.sim.test_datasets import write_mnist_like
from tests.sim.test_run import QUICK, quick


def test_device_tokens_name_links_and_weight_formats() -> None:
    assert parse_device("int8") == DeviceLink("int8", "int8", "float")
    assert parse_device("int4/fp16") == DeviceLink("int4", "fp16", "float")
    assert parse_device("binary") == DeviceLink("fp32", "fp32", "binary")
    assert parse_device("binary:int8/fp32") == DeviceLink("int8", "fp32", "binary")
    for bad in ("binary:", "binary/int8", "int3", "binary:binary"):
        with pytest.raises(ValueError, match="binary:PRECISION"):
            parse_device(bad)
    with pytest.raises(ValueError, match="binary"):
        SimConfig(device_precisions=("fp32", "ternary"))


def test_feddf_fuses_float_int8_and_binary_devices(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_mnist_like(tmp_path / "proxy", n_train=200, n_test=1)
    config = quick(
        strategy="feddf",
        participation=1.0,
        transport="inproc",
        proxy_data=tmp_path / "proxy",
        device_precisions=("fp32", "int8", "binary"),
        training=QUICK.model_copy(update={"qat": True}),
        state_dir=tmp_path / "state",
    )

    with caplog.at_level(logging.INFO, logger="coordinator.strategies"):
        report = run_simulation(config)

    assert [r.round for r in report.rounds] == [1, 2]
    for record in report.rounds:
        assert record.active_devices == 6
        # the global model as float, int8 and binary devices run it, each scored
        assert set(record.models) == {"aca", "aca@int8", "aca@binary"}
        assert all(math.isfinite(m.amp) for m in record.models.values())
    registry = RunState(FileStore(tmp_path / "state" / "coordinator")).load_registry()
    formats = sorted(entry.weight_format for entry in registry.values())
    assert formats == ["binary", "binary", "float", "float", "float", "float"]
    links = sorted(entry.downlink_precision for entry in registry.values())
    assert links == ["fp32", "fp32", "fp32", "fp32", "int8", "int8"]
    # the int8 links trained with QAT (--qat), so FedDF takes them at int8 too
    fused = [r.getMessage() for r in caplog.records if "distilled from" in r.getMessage()]
    assert len(fused) == 2
    assert all("6 teacher(s) (weights 2 binary, 2 float, 2 int8)" in m for m in fused)


def test_a_fleet_scores_its_model_at_each_weight_format_its_devices_run() -> None:
    """Binarizing the global model is what a binary device runs: it scores otherwise."""
    config = quick(transport="inproc", device_precisions=("fp32", "binary"))

    report = run_simulation(config)

    final = report.rounds[-1].models
    assert set(final) == {"aca", "aca@binary"}
    assert final["aca"].amp != final["aca@binary"].amp
    assert set(run_simulation(quick(transport="inproc")).rounds[-1].models) == {"aca"}
