"""oneshot: the label-aware ensemble (counts, energy and estimated weighting), the strategy's
server step with its held-out report, consent, one-shot rounds and the resume
fingerprint."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from coordinator.config import CoordinatorConfig
from coordinator.context import ServerContext
from coordinator.errors import ConfigError
from coordinator.evaluation import evaluate_accuracy
from coordinator.runtime import build_models
from coordinator.strategies.base import Aggregated, Contribution
from coordinator.strategies.dense import hard_samples
from coordinator.strategies.ensemble import ensemble_logits, kl_to_ensemble
from coordinator.strategies.oneshot import (
    COUNTS_STUDENT_LR,
    LabelAwareEnsemble,
    OneShot,
    class_shares,
)
from coordinator.strategies.registry import build_strategy
from models import load_state_arrays, state_arrays
from protocol.messages import Hello
from protocol.tensors import Precision
from tests.coordinator.strategies.test_dense import TINY_FLAGS, model

CPU = torch.device("cpu")


class Fixed(nn.Module):
    """A member whose logits are the same for every sample."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__()
        self.register_buffer("logits", torch.tensor(logits))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.get_buffer("logits").expand(len(x), -1)


def test_class_shares_split_each_class_among_the_members_that_saw_it() -> None:
    counts = torch.tensor([[10.0, 0.0, 0.0], [30.0, 5.0, 0.0]])
    shares = class_shares(counts)
    torch.testing.assert_close(shares, torch.tensor([[0.25, 0.0, 0.5], [0.75, 1.0, 0.5]]))


def test_a_member_that_never_saw_a_class_does_not_vote_for_it() -> None:
    """A sample of class 2: the member that saw class 2 says so mildly; a member that saw
    only class 0 must pick one of its outputs and says class 1, loudly. The mean of the
    logits follows the loud member; the counts-weighted ensemble counts each member's
    vote for a class by its share of that class (nobody saw class 1: equal shares)."""
    loud, knows = Fixed([0.0, 9.0, 0.0]), Fixed([0.0, 0.0, 3.0])
    counts = torch.tensor([[100.0, 0.0, 0.0], [0.0, 0.0, 100.0]])
    x = torch.zeros(4, 2)
    p_loud, p_knows = loud(x).softmax(1), knows(x).softmax(1)
    assert ((loud(x) + knows(x)) / 2).argmax(1).tolist() == [1] * 4  # the mean: wrong

    out = LabelAwareEnsemble([loud, knows], "counts", counts)(x)

    assert out.argmax(1).tolist() == [2] * 4
    expected = torch.stack(
        [p_loud[:, 0], 0.5 * p_loud[:, 1] + 0.5 * p_knows[:, 1], p_knows[:, 2]], 1
    ).log()
    torch.testing.assert_close(out, expected)


def test_energy_weighting_follows_the_member_with_larger_logits_per_sample() -> None:
    confident, unsure = Fixed([8.0, 0.0]), Fixed([0.0, 0.5])
    x = torch.zeros(3, 1)
    out = LabelAwareEnsemble([confident, unsure], "energy")(x)
    logits = torch.stack([confident(x), unsure(x)])
    gate = logits.logsumexp(-1).softmax(0)  # (2, 3)
    expected = (gate[..., None] * logits.softmax(-1)).sum(0).log()
    torch.testing.assert_close(out, expected)
    assert out.argmax(1).tolist() == [0, 0, 0] and bool((gate[0] > 0.99).all())


class Knows(nn.Module):
    """A member on one-hot "images" of 4 classes that recognises the classes it saw and
    calls every other one its first class, confidently."""

    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        table = torch.full((4, 4), -4.0)
        for k in range(4):
            table[k, k if k in seen else seen[0]] = 4.0
        self.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.get_buffer("table")


def test_estimated_weighting_finds_who_saw_each_class_from_predictions_alone() -> None:
    """Member 0 saw classes 0 and 1, member 1 classes 2 and 3, and each is as loud on
    every sample (energy cannot tell them apart). After observing class-balanced samples
    the estimate gives each class to the member that saw it, and the ensemble weighs each
    member's vote for a class by the gate times that share."""
    members = [Knows([0, 1]), Knows([2, 3])]
    balanced = torch.eye(4).repeat(8, 1)  # 8 samples of each class
    ensemble = LabelAwareEnsemble(
        members, "estimated", sizes=torch.tensor([100.0, 100.0]), warmup=2
    )
    energy = LabelAwareEnsemble(members, "energy")

    torch.testing.assert_close(ensemble(torch.eye(4)), energy(torch.eye(4)))  # warming up
    ensemble.observe(balanced)
    assert ensemble.estimated_shares() is None
    ensemble.observe(balanced)

    shares = ensemble.estimated_shares()
    assert shares is not None
    torch.testing.assert_close(shares.sum(0), torch.ones(4))
    assert shares.argmax(0).tolist() == [0, 0, 1, 1]
    assert bool((shares.max(0).values > 0.6).all())
    x = torch.eye(4)
    logits = torch.stack([member(x) for member in members])  # (2, 4, 4)
    weight = logits.logsumexp(-1).softmax(0)[..., None] * shares[:, None, :]
    expected = (weight / weight.sum(0) * logits.softmax(-1)).sum(0).log()
    torch.testing.assert_close(ensemble(x), expected)
    # a class's sample: the member that saw it counts with its share (~1), not half
    assert bool((ensemble(x).exp().diagonal() > energy(x).exp().diagonal() + 0.4).all())


def test_estimated_shares_scale_with_the_members_sample_counts() -> None:
    """Two members that predict alike: the estimate splits each class by sample count."""
    members = [Knows([0, 1, 2, 3]), Knows([0, 1, 2, 3])]
    ensemble = LabelAwareEnsemble(members, "estimated", sizes=torch.tensor([30.0, 10.0]))
    for _ in range(ensemble.warmup):
        ensemble.observe(torch.eye(4))
    shares = ensemble.estimated_shares()
    assert shares is not None
    torch.testing.assert_close(shares, torch.tensor([[0.75] * 4, [0.25] * 4]))


def test_an_ensemble_refuses_what_it_cannot_weigh() -> None:
    with pytest.raises(ValueError, match="needs every member's label counts"):
        LabelAwareEnsemble([Fixed([0.0, 1.0])], "counts")
    with pytest.raises(ValueError, match="at least one member"):
        LabelAwareEnsemble([], "energy")
    with pytest.raises(ValueError, match="needs every member's sample count"):
        LabelAwareEnsemble([Fixed([0.0, 1.0])], "estimated", sizes=torch.ones(2))
    with pytest.raises(ValueError, match="observe is for estimated weighting"):
        LabelAwareEnsemble([Fixed([0.0, 1.0])], "energy").observe(torch.zeros(2, 1))


def oneshot_config(**overrides: object) -> CoordinatorConfig:
    return CoordinatorConfig.model_validate(
        {"fleet": "test", "model": "lenet5", "seed": 1, "strategy": "oneshot", **TINY_FLAGS}
        | overrides
    )


def contributions(with_counts: bool) -> list[Contribution]:
    out = []
    for i in range(3):
        counts = tuple(int(c) for c in np.roll([50, 30] + [0] * 8, 3 * i)) if with_counts else None
        weights = state_arrays(model("lenet5", 10 + i))
        out.append(Contribution(f"dev-{i}", "lenet5", weights, 80, counts))
    return out


@pytest.mark.parametrize(
    ("configured", "with_counts", "weighting"),
    [
        ("auto", True, "counts"),
        ("auto", False, "estimated"),
        ("energy", True, "energy"),
        ("estimated", True, "estimated"),
    ],
)
def test_the_strategy_distils_and_reports_the_ensemble_beside_the_student(
    configured: str, with_counts: bool, weighting: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = oneshot_config(oneshot_weighting=configured)
    templates = build_models(cfg)
    strategy = build_strategy(cfg, templates)
    assert isinstance(strategy, OneShot)
    asked = configured in ("auto", "counts")
    assert strategy.uplink().label_counts == asked  # asked only if used
    current = {name: {"aca": state_arrays(t)} for name, t in templates.items()}
    rng = np.random.default_rng(0)
    x = rng.random((64, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 10, 64)
    context = ServerContext.for_round(CPU, 1, 1, held_out=(x, y))

    with caplog.at_level("INFO", "coordinator.strategies.oneshot"):
        result = strategy.aggregate(current, contributions(with_counts), 1, context)

    assert isinstance(result, Aggregated)
    assert f"the {weighting}-weighted ensemble of 3 upload(s)" in caplog.text
    metrics = result.metrics
    assert set(metrics) == {"ensemble_accuracy", "lenet5/student_accuracy", "lenet5/kl_after"}
    student = templates["lenet5"]
    load_state_arrays(student, result.models["lenet5"]["aca"])
    assert metrics["lenet5/student_accuracy"] == pytest.approx(
        100 * evaluate_accuracy(student, x, y)
    )
    without = strategy.aggregate(
        current, contributions(with_counts), 1, ServerContext.for_round(CPU, 1, 1)
    )
    assert isinstance(without, Aggregated) and set(without.metrics) == {"lenet5/kl_after"}


def hello(consents: bool) -> Hello:
    return Hello(
        device_id="dev-1",
        architecture="lenet5",
        fingerprint="0" * 16,
        precisions=(Precision.FP32,),
        memory_bytes=0,
        threads=1,
        software_version="t",
        num_samples=5,
        share_label_counts=consents,
    )


def test_counts_weighting_needs_consent_and_the_others_do_not() -> None:
    for weighting, refused in (
        ("counts", True),
        ("auto", False),
        ("energy", False),
        ("estimated", False),
    ):
        cfg = oneshot_config(oneshot_weighting=weighting)
        strategy = build_strategy(cfg, build_models(cfg))
        assert strategy.refuse(hello(consents=True)) is None
        reason = strategy.refuse(hello(consents=False))
        assert (reason is not None) == refused
        assert reason is None or "--share-label-counts" in reason


def test_oneshot_is_one_round_of_every_device_and_its_settings_are_fingerprinted() -> None:
    cfg = oneshot_config()
    assert (cfg.rounds, cfg.participation) == (1, 1.0)
    with pytest.raises(ConfigError, match="oneshot is one-shot: run it with --rounds 1"):
        build_strategy(oneshot_config(rounds=2), build_models(cfg))
    fields = cfg.fingerprint_fields()
    assert fields["oneshot_weighting"] == "estimated" and fields["dense_epochs"] == 3
    assert oneshot_config(oneshot_weighting="counts").fingerprint_fields() != fields
    assert "oneshot_weighting" not in oneshot_config(strategy="dense").fingerprint_fields()


def test_oneshot_distils_longer_than_dense_by_default() -> None:
    bare = {"fleet": "test", "model": "lenet5"}
    ours = CoordinatorConfig.model_validate(bare | {"strategy": "oneshot"})
    dense = CoordinatorConfig.model_validate(bare | {"strategy": "dense"})
    assert (ours.dense_epochs, ours.dense_student_steps) == (80, 40)
    assert (dense.dense_epochs, dense.dense_student_steps) == (20, 20)
    settings = build_strategy(ours, build_models(ours)).settings
    assert (settings.extra_batches, settings.memory_batches, settings.student_lr) == (8, 200, 1e-3)
    assert settings.student_steps == 40 and settings.start_from_average


def test_counts_weighting_distils_at_its_own_learning_rate() -> None:
    config = CoordinatorConfig.model_validate(
        {"fleet": "test", "model": "lenet5", "strategy": "oneshot"}
    )
    strategy = build_strategy(config, build_models(config))
    assert isinstance(strategy, OneShot)
    assert strategy.settings_for("counts").student_lr == COUNTS_STUDENT_LR
    assert strategy.settings_for("counts").student_lr != strategy.settings.student_lr
    for weighting in ("estimated", "energy"):
        assert strategy.settings_for(weighting) == strategy.settings


def test_hard_samples_move_towards_disagreement_and_stay_images() -> None:
    teacher, student = model("lenet5", 3).eval(), model("lenet5", 4).train()
    samples = torch.rand(32, 1, 28, 28, generator=torch.Generator().manual_seed(2))

    hard = hard_samples(samples, [teacher], [student], steps=3, epsilon=0.1, images=True)

    assert student.training  # left as it was
    assert all(p.requires_grad and p.grad is None for p in student.parameters())
    assert float((hard - samples).abs().max()) <= 0.1 + 1e-6
    assert float(hard.min()) >= 0.0 and float(hard.max()) <= 1.0
    student.eval()
    with torch.no_grad():
        before = kl_to_ensemble(student(samples), ensemble_logits([teacher], samples))
        after = kl_to_ensemble(student(hard), ensemble_logits([teacher], hard))
    assert after > before
