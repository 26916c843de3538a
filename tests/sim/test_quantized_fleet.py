"""A mixed-precision fleet end to end through a real Mosquitto: each device asks for its
own precisions in its hello; a sniffer checks what actually travels to and from each."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from protocol.messages import Hello, Message, ModelPayload, RoundTask, Update
from protocol.tensors import Encoding
from sim.run import SimConfig, run_simulation
from tests.protocol.brokers import Mosquitto
from tests.sim.test_modes import QUICK, Sniffer, broker  # noqa: F401  (fixture)

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

# device i asks for LINKS[i % 3]: (downlink, uplink)
LINKS = ("fp32", "int8", "int4/fp16")
EXPECTED = {
    0: ("fp32", "fp32"),
    1: ("int8", "int8"),
    2: ("int4", "fp16"),
}
MATRIX_ENCODING = {
    "fp32": Encoding.FP32,
    "fp16": Encoding.FP16,
    "int8": Encoding.INT8_CH,
    "int4": Encoding.INT4_CH,
}


def _device(topic: str) -> str:
    return topic.split("/")[3]


def _matrix_encodings(message: Message) -> set[Encoding]:
    """Encodings of the rank >= 2 tensors of a model or update."""
    return {t.encoding for s in message.tensor_sets().values() for t in s if len(t.shape) >= 2}


def test_mixed_precision_fleet_through_mosquitto(broker: Mosquitto, tmp_path: Path) -> None:  # noqa: F811
    config = SimConfig(
        devices=6,
        rounds=4,
        participation=0.5,
        model="lenet5",
        training=QUICK,
        transport="mqtt",
        broker_url=broker.url,
        fleet="mixed",
        state_dir=tmp_path,
        device_precisions=LINKS,
    )
    with Sniffer(broker.url, "mixed") as sniffer:
        report = run_simulation(config)

    assert [r.active_devices for r in report.rounds] == [3, 3, 3, 3]
    final = report.final
    assert math.isfinite(final["models"]["aca"]["amp"])
    devices = sorted({h.device_id for h in sniffer.bodies(Hello)})
    link_of = {d: EXPECTED[i % 3] for i, d in enumerate(devices)}
    for hello in sniffer.bodies(Hello):
        assert hello.downlink_precision is not None and hello.uplink_precision is not None
        asked = (hello.downlink_precision.value, hello.uplink_precision.value)
        assert asked == link_of[hello.device_id]

    deltas_down = 0
    seen_devices: set[str] = set()
    for topic, message in sniffer.snapshot():
        body = message.body
        if isinstance(body, RoundTask):
            down, up = link_of[_device(topic)]
            assert body.downlink_precision.value == down
            assert body.uplink.precision.value == up
            assert body.uplink.mode == ("full" if up == "fp32" else "delta")
        elif isinstance(body, ModelPayload):
            device = _device(topic)
            down, _ = link_of[device]
            assert _matrix_encodings(message) == {MATRIX_ENCODING[down]}
            (model_set,) = body.sets.values()
            if model_set.mode == "delta":
                deltas_down += 1
                assert down != "fp32" and len(model_set.base or "") == 16
        elif isinstance(body, Update):
            device = _device(topic)
            seen_devices.add(device)
            _, up = link_of[device]
            weights = body.sets["weights"]
            assert _matrix_encodings(message) == {MATRIX_ENCODING[up]}
            assert weights.mode == ("full" if up == "fp32" else "delta")
            arrays = weights.to_arrays()
            assert all(np.isfinite(a).all() for a in arrays.values())
    # every kind of device trained, and a device selected twice got a delta downlink
    assert {EXPECTED[i % 3] for i, d in enumerate(devices) if d in seen_devices} == set(
        EXPECTED.values()
    )
    assert deltas_down >= 1
