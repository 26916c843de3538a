"""local_update and validate_task: the device step shared with the sim."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.errors import TaskError
from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update
from edge_client.train.task import LocalTask
from models import state_arrays
from tests.edge_client.train.helpers import HP, distance, global_arrays, model, small_data


@pytest.fixture(scope="module")
def device_data() -> DeviceData:
    return small_data()


def test_a_task_without_sets_trains_the_current_model(device_data: DeviceData) -> None:
    net = model()
    before = state_arrays(net)

    result = local_update(net, device_data, LocalTask("fedavg", HP), state={})

    assert distance(result.sets["weights"], before) > 0


@pytest.mark.parametrize(
    ("task", "message"),
    [
        (LocalTask("nope", HP, {}), "unknown strategy"),
        (LocalTask("fedavg", {"lr": -1.0}, {}), "invalid hyperparameters"),
        (LocalTask("fedprox", HP, {"teacher": {}}), "needs the set 'global'"),
        (LocalTask("fedavg", HP, {"teacher": {}}), r"takes \['global', 'head'\]"),
        (
            LocalTask("fedavg", HP, {"global": {"head.weight": np.zeros((4, 200), np.float32)}}),
            "missing",
        ),
    ],
)
def test_invalid_tasks_raise_before_touching_the_model(
    device_data: DeviceData, task: LocalTask, message: str
) -> None:
    net = model()
    before = state_arrays(net)

    with pytest.raises(TaskError, match=message):
        local_update(net, device_data, task)

    assert distance(state_arrays(net), before) == 0


def test_mismatched_shapes_are_task_errors(device_data: DeviceData) -> None:
    received = global_arrays()
    received["head.bias"] = np.zeros(7, np.float32)
    net = model()
    before = state_arrays(net)

    with pytest.raises(TaskError, match=r"wrong shape \['head.bias'\]"):
        local_update(net, device_data, LocalTask("fedavg", HP, {"global": received}))

    assert distance(state_arrays(net), before) == 0


def test_unknown_sets_and_unsupported_uploads_are_task_errors(device_data: DeviceData) -> None:
    received = global_arrays()
    net = model()
    before = state_arrays(net)

    with pytest.raises(
        TaskError, match=r"does not use the set\(s\) \['teacher'\]; it takes \['global'\]"
    ):
        local_update(
            net, device_data, LocalTask("fedprox", HP, {"global": received, "teacher": received})
        )
    with pytest.raises(TaskError, match=r"uploads \['all'\], not 'head'"):
        local_update(
            net, device_data, LocalTask("fedprox", HP, {"global": received}, upload="head")
        )

    assert distance(state_arrays(net), before) == 0
