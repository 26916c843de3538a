"""The resident parameters: models' parameters as views of stacked rows, kept right."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update
from edge_client.train.task import LocalTask
from models import Classifier, build_classifier, state_arrays
from sim.cohort.engine import Member, train_cohort
from sim.cohort.resident import Resident, ResidentWeights


def mlp(seed: int) -> Classifier:
    torch.manual_seed(seed)
    return build_classifier("mlp", num_classes=3, in_channels=1, image_size=4)


def rows_of(weights: ResidentWeights, models: list[Classifier]) -> list[int]:
    return [row for _, row in weights.place(models)]


def test_a_resident_models_parameters_are_views_of_its_row() -> None:
    models = [mlp(seed) for seed in range(3)]
    before = [state_arrays(m) for m in models]
    weights = ResidentWeights()
    placed = weights.place(models)
    assert [row for _, row in placed] == [0, 1, 2]
    stack = placed[0][0]
    for model, values in zip(models, before, strict=True):  # values kept
        assert all(np.array_equal(v, state_arrays(model)[k]) for k, v in values.items())
    name, param = next(iter(models[1].named_parameters()))
    with torch.no_grad():
        stack.tensors[name][1].fill_(0.5)  # the stack's row is the model's parameter
    assert torch.all(param == 0.5)
    with torch.no_grad():
        param.fill_(-1.0)  # and back
    assert torch.all(stack.tensors[name][1] == -1.0)
    assert torch.all(stack.tensors[name][0] != -1.0)
    per_model = sum(p.numel() * p.element_size() for p in models[0].parameters())
    assert weights.nbytes == stack.capacity * per_model


def test_growing_keeps_every_resident_models_values_and_views() -> None:
    weights = ResidentWeights()
    first = [mlp(seed) for seed in range(3)]
    weights.place(first)
    with torch.no_grad():
        next(first[2].parameters()).fill_(7.0)  # a value only the view holds
    expected = [state_arrays(m) for m in first]
    more = [mlp(seed) for seed in range(3, 40)]
    placed = weights.place(first + more)
    stack = placed[0][0]
    assert stack.capacity >= 40
    assert rows_of(weights, first + more) == list(range(40))
    for model, values in zip(first, expected, strict=True):
        got = state_arrays(model)
        assert all(np.array_equal(v, got[k]) for k, v in values.items())
        name, param = next(iter(model.named_parameters()))
        row = rows_of(weights, [model])[0]
        assert param.data_ptr() == stack.tensors[name][row].data_ptr()


def test_a_replaced_parameter_is_adopted_again_with_its_current_values() -> None:
    """A model whose parameter stopped being its row's view (moved to a GPU and back
    by the per-device path, say) trains from its own current values, not the row's."""
    data = DeviceData(
        "d",
        np.random.default_rng(0).random((12, 1, 4, 4), dtype=np.float32),
        np.arange(12, dtype=np.int64) % 3,
        np.zeros((0, 1, 4, 4), np.float32),
        np.zeros((0,), np.int64),
        3,
    )
    start = mlp(0)
    task = LocalTask("fedavg", {"batch_size": 4, "seed": 1}, {})
    weights = ResidentWeights()
    model = copy.deepcopy(start)
    weights.place([model])
    name, param = next(iter(model.named_parameters()))
    param.data = param.data.clone().add_(0.25)  # no longer the row
    reference = copy.deepcopy(model)
    expected = local_update(reference, data, task)
    (outcome,) = train_cohort([Member(model, data, task)], resident=weights)
    assert outcome.result is not None
    got, want = outcome.result.sets["weights"], expected.sets["weights"]
    assert max(float(np.abs(got[k] - want[k]).max()) for k in want) <= 1e-5
    stack, row = weights.place([model])[0]
    assert param.data_ptr() == stack.tensors[name][row].data_ptr()


def test_consecutive_rows_are_taken_in_place_and_others_gathered() -> None:
    models = [mlp(seed) for seed in range(4)]
    weights = ResidentWeights()
    stack = weights.place(models)[0][0]
    names = list(stack.names)
    taken, in_place = Resident(stack, (1, 2)).take(names, torch.device("cpu"))
    assert in_place
    assert taken[names[0]].data_ptr() == stack.tensors[names[0]][1].data_ptr()
    gathered, in_place = Resident(stack, (0, 3)).take(names, torch.device("cpu"))
    assert not in_place
    with torch.no_grad():
        for value in gathered.values():
            value.fill_(3.0)
    assert all(torch.all(p != 3.0) for p in models[3].parameters())
    Resident(stack, (0, 3)).put(gathered)
    assert all(torch.all(p == 3.0) for p in models[3].parameters())
    assert all(torch.all(p != 3.0) for p in models[1].parameters())


def test_a_resident_model_whose_shapes_changed_is_refused() -> None:
    model = mlp(0)
    weights = ResidentWeights()
    weights.place([model])
    param = next(iter(model.parameters()))
    param.data = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="changed its parameters"):
        weights.place([model])


def test_an_architecture_is_first_made_with_the_room_its_fleet_expects() -> None:
    weights = ResidentWeights({"mlp": 10})
    first = [mlp(seed) for seed in range(3)]
    stack = weights.place(first)[0][0]
    assert stack.capacity == 10
    tensors = dict(stack.tensors)
    weights.place(first + [mlp(seed) for seed in range(3, 10)])  # joins without a copy
    assert all(stack.tensors[n] is t for n, t in tensors.items())
    weights.place([mlp(10)])  # one more than expected: half again the room
    assert stack.capacity == 15
