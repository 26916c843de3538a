"""The batched cohort engine against the per-device reference, strategy by strategy.

Every case trains the same devices (ragged datasets, so devices take different numbers
of steps and short last batches) once with :func:`local_update` one after the other and
once with :func:`train_cohort`, and bounds the largest difference of the uploads and of
the metrics.

The bounds follow from what the computation can differ by. Both paths compute the same
sums in a different order (one device's matrix products against a cohort's batched ones,
split over however many threads and vector lanes the CPU's kernels use), so each float32
result may differ by rounding: :data:`WEIGHT_TOLERANCE` bounds that for the classifiers.
FedKF's image generator adds a discontinuity: its one-hot loss labels each generated
sample with the argmax of the teacher's logits, and where two logits nearly tie, a
difference at the rounding level picks the other label and moves the generator by a step
of its own (then Adam, which divides by the root of tiny second moments, carries it on).
How large that step is depends on the CPU's kernels, not on the engine, so the generator's
bound is measured, not picked: the reference is run again with the teacher's weights one
unit in the last place up and down, and its own distance from itself is what rounding
alone can do on this machine (:func:`_rounding_sensitivity`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from edge_client.errors import TaskError
from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update
from edge_client.train.strategies.fedkf import GENERATOR_STATE_KEY
from edge_client.train.task import LocalResult, LocalTask
from models import (
    Classifier,
    LatentGenerator,
    LatentGeneratorConfig,
    build_classifier,
    state_arrays,
)
from sim.cohort.engine import Member, SampleCache, train_cohort
from sim.cohort.resident import ResidentWeights

NUM_CLASSES = 4
SIZES = (23, 40, 17, 33)
WEIGHT_TOLERANCE = 1e-5
METRIC_TOLERANCE = 1e-5


SIDE = {"lenet5": 28}
"""Image side per model (8 where the model takes it: fast)."""


def classifier(name: str, seed: int = 0) -> Classifier:
    torch.manual_seed(seed)
    side = SIDE.get(name, 8)
    return build_classifier(name, num_classes=NUM_CLASSES, in_channels=1, image_size=side)


def devices(side: int = 8) -> list[DeviceData]:
    rng = np.random.default_rng(7)
    out = []
    for index, n in enumerate(SIZES):
        x = rng.random((n, 1, side, side), dtype=np.float32)
        y = rng.integers(0, NUM_CLASSES, n).astype(np.int64)
        out.append(DeviceData(f"dev-{index}", x, y, x[:0], y[:0], NUM_CLASSES))
    return out


def latent_generator(latent_dim: int) -> dict[str, np.ndarray]:
    torch.manual_seed(9)
    generator = LatentGenerator(
        LatentGeneratorConfig(hidden_dim=32, num_classes=NUM_CLASSES, latent_dim=latent_dim)
    )
    generator.train()
    with torch.no_grad():
        for _ in range(3):
            generator(torch.randn(16, 32), torch.arange(16) % NUM_CLASSES)
    return state_arrays(generator)


@dataclass(frozen=True)
class Case:
    strategy: str
    model: str = "lenet5"
    hyper: dict[str, Any] = field(default_factory=dict)
    sets: Callable[[Classifier], dict[str, dict[str, np.ndarray]]] = lambda m: {
        "global": state_arrays(m)
    }
    upload: str = "all"


def _fedgen_sets(head_only: bool) -> Callable[[Classifier], dict[str, dict[str, np.ndarray]]]:
    def sets(model: Classifier) -> dict[str, dict[str, np.ndarray]]:
        weights = state_arrays(model, "head" if head_only else "all")
        prior = np.asarray([0.1, 0.2, 0.3, 0.4], dtype=np.float32)
        return {
            "head" if head_only else "global": weights,
            "generator": latent_generator(model.latent_dim),
            "prior": {"label_prior": prior},
        }

    return sets


def _fedkf_sets(model: Classifier) -> dict[str, dict[str, np.ndarray]]:
    teacher = classifier(model.architecture, 5)
    return {"student": state_arrays(model), "teacher": state_arrays(teacher)}


FEDGEN = {"generative_alpha": 0.5, "generator_hidden": 32, "generator_batch_size": 6}
FEDKF = {"generator_width": 4, "generator_noise_dim": 8}

CASES = {
    "fedavg": Case("fedavg"),
    "fedavg-mlp-no-momentum": Case("fedavg", "mlp", {"momentum": 0.0}),
    "fedavg-weight-decay": Case("fedavg", hyper={"weight_decay": 0.01}),
    "fedavg-resnet8": Case("fedavg", "resnet8", {"local_epochs": 1}),
    "fedavg-head-only": Case(
        "fedavg", sets=lambda m: {"head": state_arrays(m, "head")}, upload="head"
    ),
    "fedavg-oca": Case("fedavg_oca"),
    "fedprox": Case("fedprox", hyper={"mu": 0.5}),
    "qat": Case("fedavg", hyper={"qat": True}),
    "fedprox-qat": Case("fedprox", hyper={"mu": 0.5, "qat": True}),
    "fedgen": Case("fedgen", hyper=FEDGEN, sets=_fedgen_sets(False)),
    "fedgen-head-only": Case("fedgen", hyper=FEDGEN, sets=_fedgen_sets(True), upload="head"),
    "fedkf": Case("fedkf", hyper=FEDKF, sets=_fedkf_sets),
    "fedkf-minus": Case("fedkf", hyper=FEDKF, sets=lambda m: {"student": state_arrays(m)}),
    # the cheaper settings: the generator every 2nd batch, a generated batch for 3 steps,
    # generated batches of their own size (not the data's: no grouping by batch size)
    "fedkf-sparse": Case(
        "fedkf",
        hyper={**FEDKF, "generator_every": 2, "sample_reuse": 3, "generator_batch_size": 5},
        sets=_fedkf_sets,
    ),
    "fedkf-qat": Case("fedkf", hyper={**FEDKF, "qat": True}, sets=_fedkf_sets),
    "binarize": Case("fedavg", hyper={"binarize": True}),
    "fedprox-binarize": Case("fedprox", hyper={"mu": 0.5, "binarize": True}),
    # a learning rate large enough that the latent weights reach the clip
    "binarize-clipped-mlp": Case("fedavg", "mlp", {"binarize": True, "lr": 2.0}),
    "fedkf-binarize": Case("fedkf", hyper={**FEDKF, "binarize": True}, sets=_fedkf_sets),
}


def _tasks(case: Case, model: Classifier, round_: int) -> list[LocalTask]:
    sets = case.sets(model)
    return [
        LocalTask(
            case.strategy,
            {"seed": 100 * round_ + i, "batch_size": 8, "local_epochs": 2, **case.hyper},
            sets,
            case.upload,  # type: ignore[arg-type]
        )
        for i in range(len(SIZES))
    ]


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


def _compare(batched: LocalResult, reference: LocalResult) -> None:
    assert batched.steps == reference.steps
    assert batched.num_samples == reference.num_samples
    assert _max_diff(batched.sets["weights"], reference.sets["weights"]) <= WEIGHT_TOLERANCE
    assert batched.metrics.keys() == reference.metrics.keys()
    for name, value in reference.metrics.items():
        assert batched.metrics[name] == pytest.approx(value, abs=METRIC_TOLERANCE), name


PARTICIPANTS = ((0, 1, 2, 3), (3, 0, 2))
"""The devices that train in each round, in the order their tasks come (the second round
starts from the state the first left; device 1 sits it out)."""
ROUNDS = len(PARTICIPANTS)


def _nudged(sets: dict[str, dict[str, np.ndarray]], direction: float) -> None:
    """Move every float of the teacher's weights one unit in the last place (in place;
    the single downlink's teacher is the student it sends)."""
    teacher = sets["teacher"] if "teacher" in sets else sets["student"]
    for key, value in teacher.items():
        if value.dtype == np.float32:
            teacher[key] = np.nextafter(value, np.float32(direction))


def _reference_generators(
    case: Case, start: Classifier, data: list[DeviceData], direction: float | None = None
) -> list[dict[str, np.ndarray]]:
    """Each device's FedKF generator after the per-device reference's rounds, with the
    teacher nudged toward ``direction`` (one ulp) when given."""
    models = [copy.deepcopy(start) for _ in data]
    states: list[dict[str, Any]] = [{} for _ in data]
    for round_, participants in enumerate(PARTICIPANTS):
        tasks = _tasks(case, start, round_)
        for i in participants:
            if direction is not None:
                _nudged(tasks[i].sets, direction)
            local_update(models[i], data[i], tasks[i], states[i])
    return [state_arrays(state[GENERATOR_STATE_KEY].module) for state in states]


def _rounding_sensitivity(
    case: Case, start: Classifier, data: list[DeviceData], reference: list[dict[str, np.ndarray]]
) -> dict[str, float]:
    """Per generator tensor, the most any device's generator moves when the teacher moves
    by one ulp up or down: how far rounding alone carries the reference on this CPU."""
    out: dict[str, float] = {}
    for direction in (np.inf, -np.inf):
        nudged = _reference_generators(case, start, data, direction)
        for ref, moved in zip(reference, nudged, strict=True):
            for key, value in ref.items():
                distance = float(np.abs(moved[key].astype(np.float64) - value).max())
                out[key] = max(out.get(key, 0.0), distance)
    return out


@pytest.mark.parametrize("resident", [False, True], ids=["stacked", "resident"])
@pytest.mark.parametrize("name", list(CASES))
def test_batched_updates_equal_the_per_device_reference(name: str, resident: bool) -> None:
    """Stacked per round, or resident (the first round's chunks are consecutive rows
    trained in place, the second's rows 0, 2, 3 gathered and scattered back)."""
    case = CASES[name]
    start = classifier(case.model)
    data = devices(SIDE.get(case.model, 8))
    reference_models = [copy.deepcopy(start) for _ in data]
    batched_models = [copy.deepcopy(start) for _ in data]
    reference_states: list[dict[str, Any]] = [{} for _ in data]
    batched_states: list[dict[str, Any]] = [{} for _ in data]
    weights = ResidentWeights() if resident else None
    for round_, participants in enumerate(PARTICIPANTS):
        tasks = _tasks(case, start, round_)
        expected = [
            local_update(reference_models[i], data[i], tasks[i], reference_states[i])
            for i in participants
        ]
        members = [
            Member(batched_models[i], data[i], tasks[i], batched_states[i]) for i in participants
        ]
        outcomes = train_cohort(members, resident=weights, max_cohort=2 if round_ == 0 else None)
        for outcome, reference in zip(outcomes, expected, strict=True):
            assert outcome.error is None
            assert outcome.batched, outcome.fallback_reason
            assert outcome.result is not None
            _compare(outcome.result, reference)
    for ref, got in zip(reference_models, batched_models, strict=True):
        assert _max_diff(state_arrays(got), state_arrays(ref)) <= WEIGHT_TOLERANCE
    if case.strategy == "fedkf":  # each device's own generator moved as in the loop
        reference = [state_arrays(s[GENERATOR_STATE_KEY].module) for s in reference_states]
        sensitivity = _rounding_sensitivity(case, start, data, reference)
        for ref_arrays, got_state in zip(reference, batched_states, strict=True):
            got_arrays = state_arrays(got_state[GENERATOR_STATE_KEY].module)
            for key, ref_value in ref_arrays.items():
                # continuous rounding (relative: Adam's steps are normalized), plus twice
                # the discontinuous part, once for each path's rounding
                scale = max(1.0, float(np.abs(ref_value).max()))
                bound = 1e-4 * scale + 2 * sensitivity[key]
                distance = float(np.abs(got_arrays[key].astype(np.float64) - ref_value).max())
                assert distance <= bound, (key, distance, bound)


def test_devices_of_different_settings_train_in_separate_cohorts() -> None:
    start = classifier("mlp")
    data = devices()
    hypers = [{"lr": 0.1}, {"lr": 0.05}, {"lr": 0.1}, {"lr": 0.05}]
    tasks = [
        LocalTask("fedavg", {"seed": i, "batch_size": 8, **h}, {"global": state_arrays(start)})
        for i, h in enumerate(hypers)
    ]
    reference = [local_update(copy.deepcopy(start), d, t) for d, t in zip(data, tasks, strict=True)]
    members = [Member(copy.deepcopy(start), d, t) for d, t in zip(data, tasks, strict=True)]
    for outcome, expected in zip(train_cohort(members, max_cohort=1), reference, strict=True):
        assert outcome.result is not None
        _compare(outcome.result, expected)


def test_a_task_that_does_not_fit_fails_alone_and_changes_nothing() -> None:
    start = classifier("mlp")
    data = devices()
    good = LocalTask("fedavg", {"batch_size": 8}, {"global": state_arrays(start)})
    bad = LocalTask("fedavg", {"batch_size": 8, "no_such_key": 1}, {"global": state_arrays(start)})
    models = [copy.deepcopy(start) for _ in data]
    before = state_arrays(models[1])
    members = [
        Member(m, d, bad if i == 1 else good)
        for i, (m, d) in enumerate(zip(models, data, strict=True))
    ]
    outcomes = train_cohort(members)
    assert isinstance(outcomes[1].error, TaskError)
    assert _max_diff(state_arrays(models[1]), before) == 0
    assert all(o.result is not None for i, o in enumerate(outcomes) if i != 1)


def test_max_cohort_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_cohort"):
        train_cohort([], max_cohort=0)


def test_a_fleets_chunks_recur_whatever_order_its_tasks_come_in() -> None:
    """With a sample cache, the same devices make the same chunks each round (their
    samples stay resident), and each outcome is still its member's."""
    start = classifier("mlp")
    data = devices()
    task = LocalTask("fedavg", {"batch_size": 8}, {"global": state_arrays(start)})
    cache = SampleCache()
    built: list[int] = []
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]):
        chunks_before = set(cache._chunks)
        members = [Member(copy.deepcopy(start), data[i], task) for i in order]
        outcomes = train_cohort(members, max_cohort=2, samples=cache)
        built.append(len(set(cache._chunks) - chunks_before))
        for i, outcome in zip(order, outcomes, strict=True):
            assert outcome.result is not None
            assert outcome.result.num_samples == data[i].num_samples
    assert built == [2, 0, 0]
