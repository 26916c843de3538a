"""FedDF on generated images (``distill_data generator``): the pure step and the strategy."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.__main__ import build_parser, config_from_args
from coordinator.config import build_config
from coordinator.context import ServerContext
from coordinator.errors import ConfigError, StateMismatchError
from coordinator.proxy import server_proxy
from coordinator.runtime import Coordinator, build_models
from coordinator.store import FileStore
from coordinator.strategies.base import Aggregated, Contribution, NothingToAggregate
from coordinator.strategies.dense_settings import DenseSettings
from coordinator.strategies.ensemble import kl_to_ensemble, teacher_logits
from coordinator.strategies.feddf import distill, generate_images, holdout_split
from coordinator.strategies.feddf_settings import DistillSettings, GeneratedSettings
from coordinator.strategies.registry import build_strategy
from models import ImageGenerator, ImageGeneratorConfig, build_classifier, state_arrays
from protocol.transport import MemoryBroker, MemoryTransport
from tests.coordinator.helpers import config

CPU = torch.device("cpu")
SMALL = GeneratedSettings(
    batches=4, dense=dataclasses.replace(DenseSettings(), generator_steps=3, batch_size=32)
)


def seeded(name: str, seed: int):
    torch.manual_seed(seed)
    return build_classifier(name, num_classes=10)


def generator(seed: int = 0) -> ImageGenerator:
    torch.manual_seed(seed)
    return ImageGenerator(ImageGeneratorConfig(base_channels=8))


def test_distillation_on_generated_images_lowers_the_kl_on_held_out_generated_ones() -> None:
    teachers = [seeded("lenet5", 1), seeded("mlp", 2), seeded("lenet5", 3)]
    student = seeded("mlp", 4)
    start = copy.deepcopy(student)
    rng = torch.Generator().manual_seed(0)
    gen = generator()

    made = generate_images(gen, teachers, [student], classes=10, settings=SMALL, rng=rng)
    images = made.images.detach()
    ensemble = torch.stack([teacher_logits(t, images) for t in teachers]).mean(0)
    train, held_out = holdout_split(len(images), 0.25, rng)
    result = distill(
        student,
        images,
        ensemble,
        train=train,
        held_out=held_out,
        settings=DistillSettings(max_steps=150, eval_every=10, lr=3e-3),
        rng=rng,
    )

    assert images.shape == (4 * 32, 1, 28, 28) and 0 <= images.min() <= images.max() <= 1
    assert result.kl_after < 0.5 * result.kl_before
    # on images the student never saw: a fresh batch of the same generator
    with torch.no_grad():
        unseen = gen.eval()(torch.randn((64, 100), generator=rng))
    target = torch.stack([teacher_logits(t, unseen) for t in teachers]).mean(0)
    before = float(kl_to_ensemble(teacher_logits(start, unseen), target))
    after = float(kl_to_ensemble(teacher_logits(student, unseen), target))
    assert after < 0.7 * before
    assert all(not p.requires_grad for t in teachers for p in t.parameters())
    assert all(p.requires_grad for p in student.parameters())  # trainable again


def test_the_generator_learns_images_the_ensemble_recognises() -> None:
    teachers = [seeded("lenet5", 1), seeded("lenet5", 3)]
    student = seeded("mlp", 4)
    one = dataclasses.replace(SMALL, batches=1)
    longer = dataclasses.replace(one, dense=dataclasses.replace(one.dense, generator_steps=25))

    first = generate_images(
        generator(), teachers, [student], classes=10, settings=one, rng=torch.Generator()
    )
    trained = generate_images(
        generator(), teachers, [student], classes=10, settings=longer, rng=torch.Generator()
    )

    assert trained.last.ce < first.last.ce  # same noise and labels, more steps: a lower CE


def fleet_update(group: str, seed: int, index: int, samples: int = 10) -> Contribution:
    return Contribution(f"dev-{index}", group, state_arrays(seeded(group, seed)), samples)


def generated_strategy(**overrides):
    cfg = config(strategy="feddf", distill_data="generator", **overrides)
    templates = build_models(cfg)
    strategy = build_strategy(cfg, templates)
    strategy.generation = SMALL
    strategy.distillation = DistillSettings(max_steps=40, eval_every=10)
    current = {name: {"aca": state_arrays(t)} for name, t in templates.items()}
    return cfg, templates, strategy, current


def test_feddf_distils_every_group_on_generated_images_without_proxy_data() -> None:
    cfg, templates, strategy, current = generated_strategy(model="mlp,lenet5", seed=5)
    updates = [
        fleet_update("mlp", 1, 0, 10),
        fleet_update("lenet5", 2, 1),
        fleet_update("mlp", 3, 2, 30),
    ]
    context = ServerContext.for_round(CPU, cfg.seed, 1)  # no proxy data

    result = strategy.aggregate(current, iter(updates), 1, context)

    assert isinstance(result, Aggregated) and set(result.models) == {"mlp", "lenet5"}
    for group, models in result.models.items():
        shapes = {k: v.shape for k, v in state_arrays(templates[group]).items()}
        assert {k: v.shape for k, v in models["aca"].items()} == shapes
    mean_mlp = {
        k: (10 * updates[0].weights[k] + 30 * updates[2].weights[k]) / 40
        for k in updates[0].weights
    }
    assert any(not np.allclose(result.models["mlp"]["aca"][k], v) for k, v in mean_mlp.items())
    assert isinstance(strategy.aggregate(current, iter(()), 2, context), NothingToAggregate)


def test_feddf_on_generated_images_is_deterministic_per_seed_and_round() -> None:
    _, _, strategy, current = generated_strategy(model="mlp", seed=5)
    updates = [fleet_update("mlp", 1, 0), fleet_update("mlp", 2, 1)]

    def fused(seed: int, round_number: int) -> dict[str, np.ndarray]:
        context = ServerContext.for_round(CPU, seed, round_number)
        result = strategy.aggregate(current, iter(updates), round_number, context)
        assert isinstance(result, Aggregated)
        return result.models["mlp"]["aca"]

    first, again, other = fused(5, 1), fused(5, 1), fused(5, 2)

    assert all(np.array_equal(first[k], again[k]) for k in first)
    assert any(not np.array_equal(first[k], other[k]) for k in first)


def test_drop_worst_works_on_generated_images(caplog: pytest.LogCaptureFixture) -> None:
    _, _, strategy, current = generated_strategy(model="mlp", seed=5, drop_worst=True)
    good = seeded("mlp", 1)
    contrary = copy.deepcopy(good)  # its logits are minus the good ones': argmax = argmin
    with torch.no_grad():
        contrary.head.weight.neg_()
        contrary.head.bias.neg_()
    weights = [state_arrays(m) for m in (good, good, contrary)]
    updates = [Contribution(f"dev-{i}", "mlp", w, 10) for i, w in enumerate(weights)]
    context = ServerContext.for_round(CPU, 5, 1)

    with caplog.at_level(logging.WARNING, logger="coordinator.strategies"):
        result = strategy.aggregate(current, iter(updates), 1, context)

    assert isinstance(result, Aggregated)
    assert "drop-worst left out dev-2 (no better than chance on the held-out generated" in (
        caplog.text
    )


def test_distill_data_settings_are_checked() -> None:
    proxy = np.zeros((4, 28, 28), dtype=np.uint8)
    generated = config(strategy="feddf", distill_data="generator")
    on_proxy = config(strategy="feddf")

    with pytest.raises(ConfigError, match="leave out --proxy-data, or use --distill-data proxy"):
        server_proxy(proxy, build_strategy(generated, build_models(generated)), generated)
    with pytest.raises(ConfigError, match=r"give --proxy-data \(or --distill-data generator"):
        server_proxy(None, build_strategy(on_proxy, build_models(on_proxy)), on_proxy)
    with pytest.raises(ConfigError, match="'generator' is a feddf setting"):
        fedavg = config(strategy="fedavg", distill_data="generator")
        build_strategy(fedavg, build_models(fedavg))
    with pytest.raises(ConfigError, match="distill_data"):
        build_config({"strategy": "feddf", "distill_data": "images"}, {})
    with pytest.raises(ConfigError, match="distill_generator_batches"):
        build_config({"strategy": "feddf", "distill_generator_batches": 0}, {})
    assert server_proxy(None, build_strategy(generated, build_models(generated)), generated) is None


def test_a_resume_keeps_the_distillation_source(tmp_path: Path) -> None:
    """distill_data is part of the run's fingerprint: a run started on generated images
    resumes on them; switching to proxy images is refused, naming the change."""
    images = np.zeros((8, 28, 28), dtype=np.uint8)

    def start(distill_data: str, resume: bool) -> None:
        cfg = config(strategy="feddf", distill_data=distill_data, state_dir=tmp_path, resume=resume)
        proxy = images if distill_data == "proxy" else None
        transport = MemoryTransport(MemoryBroker(), "coordinator")
        coordinator = Coordinator(cfg, transport, FileStore(tmp_path), proxy_data=proxy)
        coordinator.engine.start(0.0)

    start("generator", resume=False)
    start("generator", resume=True)
    with pytest.raises(StateMismatchError, match="distill_data 'generator' -> None"):
        start("proxy", resume=True)
    assert "distill_data" not in config(strategy="feddf").fingerprint_fields()


def test_the_coordinator_command_line_takes_the_source() -> None:
    argv = ["--embedded-broker", "--strategy", "feddf", "--distill-data", "generator"]
    argv += ["--distill-generator-batches", "3", "--distill-generator-steps", "4"]

    cfg = config_from_args(build_parser().parse_args(argv))

    assert (cfg.distill_data, cfg.distill_generator_batches, cfg.distill_generator_steps) == (
        "generator",
        3,
        4,
    )


def test_the_run_settings_drive_the_generation() -> None:
    cfg = config(
        strategy="feddf",
        distill_data="generator",
        distill_generator_batches=3,
        distill_generator_steps=4,
    )

    strategy = build_strategy(cfg, build_models(cfg))

    assert strategy.generation.batches == 3
    assert strategy.generation.dense == dataclasses.replace(DenseSettings(), generator_steps=4)
