"""FedKF's device side: a local sample generator lets the teacher distil into the student.

From "Handling Data Heterogeneity in Federated Learning via Knowledge Distillation and
Fusion" (FedKF), Algorithm 1, device part T2. The device receives the student (the ACA
model) and the teacher (the OCA model; in the single-downlink variant FedKF- a frozen
copy of the student as received) and, for its local mini-batches ``(x, y)``:

1. every ``generator_every``-th batch, one Adam step of the local generator G on
   ``L_G = L_IE + lambda1 * L_OH + lambda2 * L_A`` of the teacher's outputs on
   ``G(z)``, ``z ~ N(0, I)`` of shape (Bg, noise_dim) (:func:`models.losses.
   fedkf_generator_loss`; the teacher is frozen, only G learns);
2. every batch, one SGD step of the student on
   ``CE(student(x), y) + gamma * KL(teacher(x_g) || student(x_g))`` with a generated
   batch ``x_g = G(z')`` of Bg samples, a constant (no gradient reaches G), drawn after
   the generator's step every ``sample_reuse``-th batch and reused, with its teacher's
   logits, in between.

Bg is ``generator_batch_size`` (0: the local batch size). The paper's values are
``generator_every`` 1, ``sample_reuse`` 1 and Bg = B (a generator step and a fresh
generated batch before every batch); the runtime's defaults, 2, 4 and 16 (with B = 64)
and ``generator_width`` 16, cost a device about 2.7x FedAvg's training time per round
instead of 15x, and reach the published settings' AMP and WLP on the FedKF study
(docs/results.md, ``python -m benchmarks.fedkf_cost``).

Step 1 runs in :meth:`FedKFHook.before_batch`, step 2's distillation term in
:meth:`FedKFHook.extra_loss` of the one training loop,
:func:`edge_client.train.training.train_local`; the hook's batched form (for the sim's
batched engine) takes each device's generator step with its own Adam state and adds the
same :func:`~models.losses.distillation_kl` (G's BatchNorm sees Bg generated samples
whatever the data batch's size, so all of a step's devices step together). G is never
uploaded: it stays in the device's learning state across rounds together with its Adam
moments (:func:`local_generator`), and is persisted with the device's model
(:meth:`LocalGenerator.entry`, :meth:`LocalGenerator.from_entry`;
``learning_state.npz``, :mod:`edge_client.train.client_state`), so a restarted device
goes on with the same G.

G makes samples of the model's input shape (:func:`models.sample_generator_config`): the
DCGAN-style image generator for square images, the MLP sample generator for series and
feature vectors. ``L_A`` is a term of the teacher's latents: a user's model that
declares no features / head split gives its logits as its latents.

Sets (:class:`FedKF`): ``"student"`` (required), ``"teacher"`` (optional; absent, the
teacher is a frozen copy of the received student: FedKF-). ``gamma`` 0: FedAvg on the
student, without the hook.

Compute cost. Per sample, the image generator (noise 100, 1x28x28) costs about 5.7 M
multiply-adds forward at ``generator_width`` 16 (172,545 parameters) and 87.8 M at width
64 (the DCGAN size, 856,065 parameters); LeNet-5 costs 0.42 M. At the paper's settings a
step runs G forward twice and backward once and the teacher and student on a generated
batch, so the generator dominates: measured with one CPU thread, LeNet-5, batches of 32,
a step took 3.7 ms for FedAvg, 52 ms for FedKF at width 16 (14x) and 297 ms at width 64
(80x). The cost settings above divide G's share by ``generator_every`` (its steps) and
``sample_reuse`` (its samples and the teacher's forward passes on them), and Bg scales
all of it. Memory: G's parameters plus two Adam moments, 3 x 0.7 MB at width 16 (3 x 3.4
MB at 64), and the generated batch kept for reuse.

Pure: tensors in, tensors out; the noise comes from a ``torch.Generator`` seeded from
``TrainConfig.seed`` (drawn on the CPU, so a seed gives the same noise on every device),
separate from the loop's shuffling generator.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from torch import nn

from edge_client.train.batched import (
    BatchedHook,
    StackedAdam,
    StackedTerm,
    Tensors,
    select_rows,
    stacked,
    unprefixed,
    write_back,
)
from edge_client.train.client_state import LearningStateEntry
from edge_client.train.strategies.strategy import (
    DeviceStrategy,
    SetSpec,
    as_classifier,
    from_set,
    load_set,
)
from edge_client.train.task import ReceivedSets
from edge_client.train.training import TrainConfig, TrainHook
from models import (
    Classifier,
    ImageGenerator,
    SampleGenerator,
    build_sample_generator,
    load_state_arrays,
    sample_generator_config,
    seeded,
    state_arrays,
    state_shapes,
)
from models.classifiers import FEATURES_PREFIX, HEAD_PREFIX
from models.losses import distillation_kl, fedkf_generator_loss, fedkf_generator_objective
from models.optim import Adam
from models.stacked import StackedModule
from protocol.sets import STUDENT_SET, TEACHER_SET

if TYPE_CHECKING:  # typing.Self is Python 3.11+; devices may run 3.10
    from typing import Self

__all__ = [
    "DEFAULT_NOISE_DIM",
    "GENERATOR_STATE_KEY",
    "FedKF",
    "FedKFHook",
    "LocalGenerator",
    "frozen_teacher",
    "local_generator",
]

logger = logging.getLogger(__name__)

DEFAULT_NOISE_DIM = 100
"""Noise width of the local generator when ``generator_noise_dim`` is 0."""
GENERATOR_STATE_KEY = "fedkf_generator"
"""Key of the :class:`LocalGenerator` in the device's learning state."""


def frozen_teacher(
    model: Classifier, arrays: Mapping[str, npt.ArrayLike] | None = None
) -> Classifier:
    """A frozen copy of ``model``: evaluation mode, no gradients, same device.

    Args:
        model: the classifier to copy (architecture and, without ``arrays``, weights).
        arrays: a full state to load into the copy (the received teacher); None keeps
            the copied weights (FedKF-: the teacher is the student as received).

    Raises:
        StateMismatchError: ``arrays`` do not fit the model (``model`` is untouched).
    """
    teacher = copy.deepcopy(model)
    if arrays is not None:
        load_state_arrays(teacher, arrays)
    teacher.eval()
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
        parameter.grad = None
    return teacher


def _noise_dim(config: TrainConfig) -> int:
    return config.generator_noise_dim or DEFAULT_NOISE_DIM


_MODULE, _EXP_AVG, _EXP_AVG_SQ = "module/", "exp_avg/", "exp_avg_sq/"
"""Prefixes of a stored generator's arrays: G's state (BatchNorm buffers included) and
its Adam moments, by G's parameter names."""


class _StoredGenerator(BaseModel):
    """The settings of a stored :class:`LocalGenerator`: its build signature (the
    device left out: it is the one it is restored on) and its Adam optimizer's."""

    model_config = ConfigDict(extra="forbid", strict=True)

    noise_dim: int
    sample_shape: list[int] = Field(min_length=1, max_length=8)
    width: int
    lr: float
    betas: list[float] = Field(min_length=2, max_length=2)
    eps: float
    steps: list[int]


Signature = tuple[int, tuple[int, ...], int, str]
"""What a local generator was built for: noise width, sample shape, width, device."""


@dataclass(eq=False)
class LocalGenerator:
    """The device's sample generator G with its Adam optimizer, kept across rounds."""

    module: ImageGenerator | SampleGenerator
    """G: noise (B, noise_dim) -> samples (B, *sample_shape) (images in [0, 1]); always
    in train mode."""
    optimizer: Adam
    """Adam over G's parameters; its moments persist with G."""
    signature: Signature
    """What G was built for (noise width, sample shape, width, device); a round whose
    config or model differs in any of them rebuilds G."""

    @property
    def device(self) -> torch.device:
        """Where G's parameters are."""
        return self.module.project.weight.device

    def entry(self) -> LearningStateEntry:
        """G's state, its Adam moments and step counts and its build signature, as the
        device's store keeps them (:class:`~edge_client.train.client_state.DeviceStore`)."""
        noise_dim, shape, width, _device = self.signature
        optimizer = self.optimizer
        arrays = {_MODULE + name: value for name, value in state_arrays(self.module).items()}
        names = [name for name, _ in self.module.named_parameters()]
        for index, name in enumerate(names):
            arrays[_EXP_AVG + name] = _numpy(optimizer.exp_avg[index])
            arrays[_EXP_AVG_SQ + name] = _numpy(optimizer.exp_avg_sq[index])
        settings = _StoredGenerator(
            noise_dim=noise_dim,
            sample_shape=list(shape),
            width=width,
            lr=optimizer.lr,
            betas=list(optimizer.betas),
            eps=optimizer.eps,
            steps=list(optimizer.steps),
        )
        return LearningStateEntry(settings.model_dump(), arrays)

    @classmethod
    def from_entry(
        cls, entry: LearningStateEntry, model: Classifier, device: torch.device
    ) -> LocalGenerator:
        """The generator :meth:`entry` stored, on ``device``, for ``model``'s samples.

        Raises:
            ValueError: the entry is not a generator of ``model``'s sample shape, or its
                arrays do not fit the generator its settings describe.
        """
        try:
            stored = _StoredGenerator.model_validate(dict(entry.settings))
        except ValidationError as exc:
            raise ValueError(f"not the settings of a FedKF generator: {exc}") from None
        shape = tuple(stored.sample_shape)
        if shape != tuple(model.input_shape):
            raise ValueError(
                f"the FedKF generator makes samples of shape {shape}, the model takes "
                f"{tuple(model.input_shape)}"
            )
        try:
            config = sample_generator_config(shape, noise_dim=stored.noise_dim, width=stored.width)
        except ValueError as exc:
            raise ValueError(f"not the settings of a FedKF generator: {exc}") from None
        with torch.device("meta"):  # every tensor comes from the entry: no RNG used
            module = build_sample_generator(config)
        module = module.to_empty(device=device)
        load_state_arrays(module, _prefixed(entry.arrays, _MODULE))  # StateMismatchError
        betas = (stored.betas[0], stored.betas[1])
        optimizer = Adam(module.parameters(), lr=stored.lr, betas=betas, eps=stored.eps)
        names = [name for name, _ in module.named_parameters()]
        moments = (_prefixed(entry.arrays, _EXP_AVG), _prefixed(entry.arrays, _EXP_AVG_SQ))
        if any(set(values) != set(names) for values in moments) or len(stored.steps) != len(names):
            raise ValueError("the FedKF generator's Adam state does not name its parameters")
        for index, (name, param) in enumerate(zip(names, optimizer.params, strict=True)):
            for values, kept in zip(
                moments, (optimizer.exp_avg, optimizer.exp_avg_sq), strict=True
            ):
                value = values[name]
                if value.shape != tuple(param.shape) or value.dtype != np.float32:
                    raise ValueError(
                        f"Adam moment of {name!r}: {value.dtype} {value.shape}, "
                        f"expected float32 {tuple(param.shape)}"
                    )
                kept[index] = torch.from_numpy(value.copy()).to(device=device, dtype=param.dtype)
        optimizer.steps = list(stored.steps)
        return cls(module, optimizer, (stored.noise_dim, shape, stored.width, str(device)))

    def noise(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """Noise ``z ~ N(0, I)`` of shape (batch_size, noise_dim), drawn on the CPU from
        ``generator`` and moved to G's device."""
        z = torch.randn(batch_size, self.module.noise_dim, generator=generator)
        return z.to(self.device)

    def step(
        self,
        teacher: Classifier,
        batch_size: int,
        lambda1: float,
        lambda2: float,
        generator: torch.Generator,
    ) -> tuple[float, dict[str, float]]:
        """One Adam step of G on ``L_G`` of the teacher's outputs on ``G(z)``.

        Gradients reach G only: the teacher must be frozen (see :func:`frozen_teacher`)
        and on G's device.

        Returns:
            ``L_G`` before the step and its unweighted parts (see
            :func:`models.losses.fedkf_generator_loss`).
        """
        self.module.train()
        samples = self.module(self.noise(batch_size, generator))  # (B, *sample_shape)
        features = teacher.features(samples)  # (B, latent_dim)
        logits = teacher.head(features)  # (B, num_classes)
        loss, parts = fedkf_generator_loss(logits, features, lambda1, lambda2)
        self.optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        return float(loss.detach()), parts

    def sample(self, batch_size: int, generator: torch.Generator) -> torch.Tensor:
        """Generated samples (batch_size, *sample_shape), detached from G (no gradient)."""
        self.module.train()
        with torch.no_grad():
            return self.module(self.noise(batch_size, generator))  # type: ignore[no-any-return]


def _ceil_div(steps: int, every: int) -> int:
    """Generator steps in ``steps`` local batches when it steps every ``every``-th."""
    return -(-steps // every)


def _numpy(tensor: torch.Tensor) -> npt.NDArray[Any]:
    """A CPU numpy copy of ``tensor``."""
    return tensor.detach().cpu().numpy().copy()


def _prefixed(arrays: Mapping[str, npt.NDArray[Any]], prefix: str) -> dict[str, npt.NDArray[Any]]:
    """The arrays whose names start with ``prefix``, by the rest of their names."""
    return {name[len(prefix) :]: v for name, v in arrays.items() if name.startswith(prefix)}


def local_generator(
    state: MutableMapping[str, Any],
    model: Classifier,
    config: TrainConfig,
    device: torch.device,
) -> LocalGenerator:
    """The device's generator from ``state``, built (or rebuilt) when needed.

    G makes samples of ``model``'s input shape
    (:func:`~models.generators.sample_generator_config`). A new G is built when
    ``state`` has none or when the one there was built for another noise width, sample
    shape, ``generator_width`` or device; its weights come
    from ``torch.manual_seed(config.seed)`` inside a forked RNG (the global RNG is left
    as it was). The Adam learning rate is set to ``config.generator_lr`` every round.

    Args:
        state: the device's learning state (updated under :data:`GENERATOR_STATE_KEY`).
        model: the classifier G feeds (its input shape).
        config: the round's hyperparameters.
        device: where G lives.
    """
    noise_dim = _noise_dim(config)
    shape = tuple(model.input_shape)
    signature = (noise_dim, shape, config.generator_width, str(device))
    existing = state.get(GENERATOR_STATE_KEY)
    if isinstance(existing, LocalGenerator) and existing.signature == signature:
        existing.optimizer.lr = config.generator_lr
        return existing
    generator_config = sample_generator_config(
        shape, noise_dim=noise_dim, width=config.generator_width
    )
    with seeded(config.seed):
        module = build_sample_generator(generator_config)
    module.to(device)
    optimizer = Adam(module.parameters(), lr=config.generator_lr)
    local = LocalGenerator(module, optimizer, signature)
    state[GENERATOR_STATE_KEY] = local
    logger.debug("built the FedKF generator %s", signature)
    return local


class FedKFHook(BatchedHook):
    """FedKF in the training loop: train G before each batch, distil on G's samples.

    Metrics (:meth:`metrics`): ``kd_loss``, the mean unweighted KL term, and
    ``generator_loss``, the mean ``L_G`` before each generator step; none before the
    first batch. Used only with ``gamma`` > 0: with 0 the strategy trains the student
    as FedAvg, without this hook.
    """

    def __init__(
        self, teacher: Classifier, state: MutableMapping[str, Any], config: TrainConfig
    ) -> None:
        """
        Args:
            teacher: the frozen teacher (see :func:`frozen_teacher`); moved to the
                training device when training starts.
            state: the device's learning state, where G persists.
            config: the round's hyperparameters (``gamma``, ``lambda1``, ``lambda2``,
                ``generator_*``, ``seed``).
        """
        self.teacher = teacher
        self.config = config
        self._state = state
        self.noise = torch.Generator().manual_seed(config.seed)
        """Where the generator's noise comes from (drawn on the CPU, per batch: the
        generator step's, then the distillation sample's)."""
        self.generator: LocalGenerator | None = None
        self.batch_size = config.generator_batch_size or config.batch_size
        """Generated samples per generator step and per distillation step."""
        self._sample: tuple[torch.Tensor, torch.Tensor] | None = None
        """The generated batch the distillation steps use and its teacher's logits."""
        self._kd_sum = 0.0
        self._generator_sum = 0.0
        self._steps = 0

    def before_training(self, model: nn.Module) -> None:
        device = next(model.parameters()).device
        self.teacher.to(device)
        self.generator = local_generator(self._state, self.teacher, self.config, device)

    def before_batch(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        cfg = self.config
        if self.generator is None or self._steps % cfg.generator_every:
            return
        loss, _ = self.generator.step(
            self.teacher, self.batch_size, cfg.lambda1, cfg.lambda2, self.noise
        )
        self._generator_sum += loss

    def extra_loss(
        self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, logits: torch.Tensor
    ) -> torch.Tensor | None:
        if self.generator is None:
            return None
        if self._sample is None or self._steps % self.config.sample_reuse == 0:
            generated = self.generator.sample(self.batch_size, self.noise)  # (Bg, *shape)
            with torch.no_grad():
                self._sample = generated, self.teacher(generated)  # logits (Bg, classes)
        generated, teacher_logits = self._sample
        kd = distillation_kl(teacher_logits, model(generated))
        self._kd_sum += float(kd.detach())
        self._steps += 1
        return self.config.gamma * kd

    def metrics(self) -> dict[str, float]:
        if self._steps == 0:
            return {}
        return {
            "kd_loss": self._kd_sum / self._steps,
            "generator_loss": self._generator_sum
            / _ceil_div(self._steps, self.config.generator_every),
        }

    def unbatchable(self) -> str:
        return "FedKF without a generator" if self.generator is None else ""

    @classmethod
    def stack(cls, hooks: Sequence[Self], device: torch.device) -> StackedTerm:
        return _StackedFedKF(hooks, device)


class _StackedFedKF(StackedTerm):
    """The batched form of :class:`FedKFHook`: each device's generator (its own
    Adam state) and its frozen teacher, stacked; per step, each device's generator step
    and generated batch, then the distillation term."""

    def __init__(self, hooks: Sequence[FedKFHook], device: torch.device) -> None:
        super().__init__(len(hooks), device)
        self.hooks = list(hooks)
        self.device = device
        config = hooks[0].config
        self.batch_size = hooks[0].batch_size
        self.every, self.reuse = config.generator_every, config.sample_reuse
        self.step = 0
        """Steps taken (the devices that step take theirs together: the same count)."""
        self.sample: Tensors = {}
        """Each device's current generated batch and its teacher's logits (N, Bg, ...)."""
        generators = [h.generator for h in hooks if h.generator is not None]
        self.generators = generators
        self.module = generators[0].module
        self.teacher = hooks[0].teacher
        self.gamma = hooks[0].config.gamma
        modules = [g.module for g in generators]
        self.param_names = [n for n, _ in self.module.named_parameters()]
        self.buffer_names = [n for n, _ in self.module.named_buffers()]
        self.params = stacked(modules, self.param_names, device)
        self.buffers = stacked(modules, self.buffer_names, device)
        teacher_names = [n for n, _ in self.teacher.named_parameters()]
        teacher_names += [n for n, _ in self.teacher.named_buffers()]
        self.teachers = stacked([h.teacher for h in hooks], teacher_names, device)
        self.adam = StackedAdam([g.optimizer for g in generators], self.param_names, device)
        self.generator_loss = torch.zeros(len(hooks), dtype=torch.float64, device=device)
        """Sum over the steps of each device's ``L_G`` before its generator step (N,)."""
        self.stacked = StackedModule(self.module).train()
        self.teacher_features = StackedModule(self.teacher.features).train(False)
        self.teacher_head = StackedModule(self.teacher.head).train(False)
        self.lambdas = (hooks[0].config.lambda1, hooks[0].config.lambda2)

    def _teach(self, teachers: Tensors, images: torch.Tensor) -> torch.Tensor:
        """Each row's teacher's logits on its images: head(features), as the teacher's
        forward computes them."""
        features = self.teacher_features(unprefixed(teachers, FEATURES_PREFIX), images)
        return self.teacher_head(unprefixed(teachers, HEAD_PREFIX), features)

    def inputs(self, rows: Sequence[int], index: torch.Tensor | None, width: int) -> Tensors:
        """Each row's generator step (on the steps it takes one), then each row's
        generated batch and its teacher's logits (fresh on the steps that draw one)."""
        train = self.step % self.every == 0
        fresh = not self.sample or self.step % self.reuse == 0
        self.step += 1
        z, z_sample = [], []
        for i in rows:  # per device: the step's noise, then the sample's
            noise, size = self.hooks[i].noise, (self.batch_size, self.module.noise_dim)
            if train:
                z.append(torch.randn(size, generator=noise))
            if fresh:
                z_sample.append(torch.randn(size, generator=noise))
        if not (train or fresh):
            return select_rows(index, self.sample)
        params = select_rows(index, self.params)
        buffers, teachers = select_rows(index, self.buffers), select_rows(index, self.teachers)
        if train:
            self._train_generators(
                rows, index, params=params, buffers=buffers, teachers=teachers, z=z
            )
        sample: Tensors = {}
        if fresh:
            with torch.no_grad():  # G in train mode: its BatchNorm statistics move
                images = self.stacked(params | buffers, torch.stack(z_sample).to(self.device))
                sample = {"images": images, "teacher_logits": self._teach(teachers, images)}
        if index is None:
            self.sample = sample or self.sample
            return self.sample
        for name, value in params.items():  # the rows' generators, back into the stack
            self.params[name][index] = value
        for name, value in buffers.items():
            self.buffers[name][index] = value
        for name, value in sample.items():
            kept = self.sample.setdefault(name, value.new_zeros(len(self.hooks), *value.shape[1:]))
            kept[index] = value
        return sample or select_rows(index, self.sample)

    def _train_generators(
        self,
        rows: Sequence[int],
        index: torch.Tensor | None,
        *,
        params: Tensors,
        buffers: Tensors,
        teachers: Tensors,
        z: list[torch.Tensor],
    ) -> None:
        """One Adam step of each row's generator on its noise ``z``: ``params`` (and,
        through G's BatchNorm, ``buffers``) are updated in place."""
        leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
        with torch.enable_grad():
            images = self.stacked(leaves | buffers, torch.stack(z).to(self.device))
            features = self.teacher_features(unprefixed(teachers, FEATURES_PREFIX), images)
            logits = self.teacher_head(unprefixed(teachers, HEAD_PREFIX), features)
            loss, *_ = fedkf_generator_objective(logits, features, *self.lambdas)  # (n,)
            names = list(leaves)
            values = torch.autograd.grad(loss.sum(), [leaves[k] for k in names])
        self.adam.update(params, dict(zip(names, values, strict=True)), index)
        rows_t = torch.tensor(list(rows), device=self.device)
        self.generator_loss.index_add_(0, rows_t, loss.detach().double())

    def loss(
        self, model: StackedModule, point: Tensors, state: Tensors, inputs: Tensors
    ) -> tuple[torch.Tensor, torch.Tensor]:
        student = model(state, inputs["images"])  # (n, B, classes)
        kd = distillation_kl(inputs["teacher_logits"], student)  # (n,)
        return self.gamma * kd, kd.detach()

    def metrics(self, row: int, steps: int) -> dict[str, float]:
        return {
            "kd_loss": float(self.measured[row]) / steps,
            "generator_loss": float(self.generator_loss[row]) / _ceil_div(steps, self.every),
        }

    def write_back(self) -> None:
        write_back([g.module for g in self.generators], self.params | self.buffers)
        self.adam.write_back()


class FedKF(DeviceStrategy):
    """FedKF: the received student learns from the teacher through a local generator.

    Sets: ``"student"`` (required), ``"teacher"`` (optional; absent, the teacher is a
    frozen copy of the received student: FedKF-). The generator persists in the
    learning state (see :func:`local_generator`). ``gamma`` 0: FedAvg on the student.
    """

    name = "fedkf"

    def expected_sets(self, model: nn.Module, config: TrainConfig) -> dict[str, SetSpec]:
        full = state_shapes(as_classifier(model, self.name))
        return {STUDENT_SET: SetSpec(full, required=True), TEACHER_SET: SetSpec(full, False)}

    def prepare(
        self,
        model: nn.Module,
        sets: ReceivedSets,
        config: TrainConfig,
        state: MutableMapping[str, Any],
    ) -> tuple[TrainHook, ...]:
        classifier = as_classifier(model, self.name)
        if config.gamma == 0:
            load_set(model, sets, STUDENT_SET)
            return ()
        # built first: a bad teacher leaves the model unchanged
        teacher = from_set(sets, TEACHER_SET, lambda arrays: frozen_teacher(classifier, arrays))
        load_set(model, sets, STUDENT_SET)
        if teacher is None:
            teacher = frozen_teacher(classifier)
        return (FedKFHook(teacher, state, config),)
