"""The batched cohort engine: many emulated devices' local training as one computation.

:func:`train_cohort` runs the round of every device of a cohort that shares an
architecture, a strategy and its hyperparameters (all but the shuffling seed) as one
batched computation: the devices' parameters are stacked along a leading device axis,
``torch.func.vmap(torch.func.grad(...))`` over :func:`torch.func.functional_call` gives
every device its own gradient of its own batch in one call, and the optimizer steps act
on the stacked tensors (SGD with momentum and weight decay, FedKF's Adam: elementwise,
so exactly N independent optimizers).

It computes what the per-device reference,
:func:`edge_client.train.strategies.local_update`, computes, with the same pieces:

* each device's batches come from :func:`~edge_client.train.training.batch_indices` with
  its own seed; a device with fewer batches than the longest takes no step (and its
  momentum does not move) once it is done; a short last batch is padded and masked out
  of the loss (its mean is over the real samples, as the loop's is). The classifiers
  normalise per sample (GroupNorm or none), so padding changes nothing else; FedKF's
  image generator has BatchNorm, so FedKF groups each step's devices by batch size
  instead of padding;
* the strategy prepares each device as the loop does
  (:meth:`~edge_client.train.strategies.DeviceStrategy.prepare`: received sets loaded,
  teacher and generators built) and the loss terms are the hooks' functions:
  :func:`~edge_client.train.strategies.proximal_term` (FedProx),
  :func:`~models.losses.distillation_kl` and
  :func:`~models.losses.fedkf_generator_objective` (FedKF's T2, each device's image
  generator trained with its own Adam state, which is written back for the next round),
  FedGen's :meth:`~edge_client.train.fedgen.FedGenHook.sample_latents` drawn from each
  device's own noise source, and int8 QAT and binarized weights as the straight-through
  estimator (the gradient is taken at :func:`~models.weight_formats.fake_quantize_int8`
  or :func:`~models.weight_formats.binarize` of the weights and applied to the float
  weights; binarized ones are then clipped by
  :func:`~edge_client.train.binary.clip_latent_`);
* head-only sharing and uploads, and the uplink's error feedback (in each device's
  transfer state, after training), are per device as in the loop.

Same seeds, data and hyperparameters give the loop's updates within float tolerance
(tests/sim/cohort bound the largest difference per strategy). A device the engine cannot
batch (an unknown hook, a single-sample FedKF batch) trains on the per-device path and
the outcome says why.

Pure: models, data and tasks in, results out (the members' models and learning states
are updated as the loop would update them); no I/O, no global RNG.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.func import functional_call, grad, vmap

from edge_client.errors import TaskError
from edge_client.train.binary import clip_latent_
from edge_client.train.data import DeviceData
from edge_client.train.fedgen import FedGenHook
from edge_client.train.fedkf import FedKFHook, LocalImageGenerator
from edge_client.train.strategies import (
    LocalResult,
    LocalTask,
    ProximalHook,
    device_strategy,
    local_result,
    proximal_term,
    train_prepared,
    validate_task,
)
from edge_client.train.training import TrainConfig, TrainHook, as_tensor, batch_indices
from models import Classifier
from models.classifiers import FEATURES_PREFIX, HEAD_PREFIX
from models.losses import distillation_kl, fedkf_generator_objective
from models.optim import adam_update_, sgd_update_
from models.weight_formats import binarize, fake_quantize_int8

__all__ = ["CohortOutcome", "Member", "train_cohort"]

Tensors = dict[str, torch.Tensor]


@dataclass
class Member:
    """One device of a cohort: what :func:`~edge_client.train.strategies.local_update`
    would be called with."""

    model: Classifier
    """The device's classifier, trained in place."""
    data: DeviceData
    """The device's local data."""
    task: LocalTask
    """The round's task, decoded."""
    state: MutableMapping[str, Any] = field(default_factory=dict)
    """The device's learning state across rounds (FedKF's generator)."""


@dataclass(frozen=True)
class CohortOutcome:
    """What came of one member: its result or the error its task raised."""

    result: LocalResult | None
    error: Exception | None = None
    batched: bool = True
    """Whether it trained in a batched computation (False: on the per-device path)."""
    fallback_reason: str = ""
    """Why it trained on the per-device path ("" when batched or failed)."""


@dataclass
class _Prepared:
    """A member after its strategy's ``prepare``: model loaded, hooks built."""

    member: Member
    config: TrainConfig
    hooks: tuple[TrainHook, ...]
    load_s: float
    proximal: ProximalHook | None = None
    fedkf: FedKFHook | None = None
    fedgen: FedGenHook | None = None


def _stack(values: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.stack([v.detach() for v in values]).to(device)


def _stacked(modules: Sequence[nn.Module], names: Sequence[str], device: torch.device) -> Tensors:
    """``{name: (N, ...)}`` of the named parameters / buffers of ``modules``."""
    states = [dict(m.named_parameters()) | dict(m.named_buffers()) for m in modules]
    return {name: _stack([s[name] for s in states], device) for name in names}


def _write_back(modules: Sequence[nn.Module], stacked: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for index, module in enumerate(modules):
            state = dict(module.named_parameters()) | dict(module.named_buffers())
            for name, value in stacked.items():
                state[name].copy_(value[index])


def _rows(index: torch.Tensor | None, tensors: Mapping[str, torch.Tensor]) -> Tensors:
    """The rows ``index`` of each stacked tensor (None: all of them, not copied)."""
    if index is None:
        return dict(tensors)
    return {k: v.index_select(0, index) for k, v in tensors.items()}


def _sub(tensors: Mapping[str, torch.Tensor], prefix: str) -> Tensors:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _fallback_reason(prepared: _Prepared) -> str:
    """Why ``prepared`` cannot be batched, or ""."""
    for hook in prepared.hooks:
        if not isinstance(hook, (ProximalHook, FedKFHook, FedGenHook)):
            return f"the strategy's hook {type(hook).__name__} has no batched form"
    if prepared.fedkf is not None and prepared.fedkf.generator is None:
        return "FedKF without an image generator"
    return ""


def _batch_key(prepared: _Prepared) -> tuple[object, ...]:
    """Members with equal keys train in one batched computation."""
    model = prepared.member.model
    shapes = tuple((n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters())
    hooks = tuple(type(h).__name__ for h in prepared.hooks)
    settings = prepared.config.model_dump(exclude={"seed"})
    return (
        type(model).__name__,
        shapes,
        prepared.member.task.strategy,
        prepared.member.task.upload,
        hooks,
        tuple(sorted(settings.items())),
    )


def _prepare(member: Member) -> _Prepared:
    """Validate the task and run the strategy's ``prepare`` (as the loop does).

    Raises:
        TaskError: the task does not fit the model (the model is then unchanged).
    """
    config = validate_task(member.model, member.task)
    strategy = device_strategy(member.task.strategy)
    start = time.perf_counter()
    hooks = strategy.prepare(member.model, member.task.sets, config, member.state)
    member.model.train()
    for hook in hooks:
        hook.before_training(member.model)
    prepared = _Prepared(member, config, tuple(hooks), time.perf_counter() - start)
    for hook in hooks:
        if isinstance(hook, ProximalHook):
            prepared.proximal = hook
        elif isinstance(hook, FedKFHook):
            prepared.fedkf = hook
        elif isinstance(hook, FedGenHook):
            prepared.fedgen = hook
    return prepared


def train_cohort(
    members: Sequence[Member],
    *,
    device: torch.device = torch.device("cpu"),  # noqa: B008
    max_cohort: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[CohortOutcome]:
    """Train every member's round; batched where members share a batch key.

    Args:
        members: the devices and their tasks.
        device: where to compute (the members' models stay where they are; their new
            weights are copied back).
        max_cohort: most devices in one batched computation (None: no limit); larger
            cohorts are trained in chunks.
        progress: called with the number of members finished after each chunk.

    Returns:
        One outcome per member, in order.
    """
    if max_cohort is not None and max_cohort < 1:
        raise ValueError(f"max_cohort must be >= 1, got {max_cohort}")
    outcomes: list[CohortOutcome | None] = [None] * len(members)
    groups: dict[tuple[object, ...], list[tuple[int, _Prepared]]] = {}
    for index, member in enumerate(members):
        try:
            prepared = _prepare(member)
        except TaskError as exc:
            outcomes[index] = CohortOutcome(None, exc, batched=False)
            continue
        reason = _fallback_reason(prepared)
        if reason:
            outcomes[index] = _run_loop(prepared, device, reason)
            if progress is not None:
                progress(1)
            continue
        groups.setdefault(_batch_key(prepared), []).append((index, prepared))
    for group in groups.values():
        size = max_cohort or len(group)
        for start in range(0, len(group), size):
            chunk = group[start : start + size]
            results = _BatchedRound([p for _, p in chunk], device).run()
            for (index, _), result in zip(chunk, results, strict=True):
                outcomes[index] = CohortOutcome(result)
            if progress is not None:
                progress(len(chunk))
    return [o if o is not None else CohortOutcome(None, RuntimeError("lost")) for o in outcomes]


def _run_loop(prepared: _Prepared, device: torch.device, reason: str) -> CohortOutcome:
    """The per-device path for a prepared member."""
    member = prepared.member
    try:
        result = train_prepared(
            member.model,
            member.data,
            member.task,
            prepared.config,
            prepared.hooks,
            load_s=prepared.load_s,
            device=device,
        )
    except Exception as exc:  # a training failure is the member's, not the cohort's
        return CohortOutcome(None, exc, batched=False, fallback_reason=reason)
    member.model.to("cpu")
    return CohortOutcome(result, batched=False, fallback_reason=reason)


class _StackedAdam:
    """N independent Adam optimizers over stacked parameters (:func:`adam_update_` with
    each row's own step count), each one's state taken from and written back to its
    :class:`LocalImageGenerator`'s :class:`Adam`."""

    def __init__(self, generators: Sequence[LocalImageGenerator], device: torch.device) -> None:
        self._generators = generators
        first = generators[0].optimizer
        self.lr, self.betas, self.eps = first.lr, first.betas, first.eps
        self.names = [n for n, _ in generators[0].module.named_parameters()]
        self.exp_avg = {
            n: _stack([g.optimizer.exp_avg[i] for g in generators], device)
            for i, n in enumerate(self.names)
        }
        self.exp_avg_sq = {
            n: _stack([g.optimizer.exp_avg_sq[i] for g in generators], device)
            for i, n in enumerate(self.names)
        }
        # every parameter of a generator steps together: one count per device
        steps = [float(g.optimizer.steps[0]) for g in generators]
        self.step = torch.tensor(steps, dtype=torch.float64, device=device)  # (N,)

    def update(self, params: Tensors, grads: Tensors, rows: torch.Tensor | None) -> None:
        """One step for the optimizers ``rows`` (None: all), in place on ``params``."""
        with torch.no_grad():
            if rows is None:
                self.step += 1
                step = self.step
            else:
                self.step[rows] += 1
                step = self.step[rows]
            for name in self.names:
                p = params[name]
                m = self.exp_avg[name] if rows is None else self.exp_avg[name][rows]
                v = self.exp_avg_sq[name] if rows is None else self.exp_avg_sq[name][rows]
                count = step.view((-1,) + (1,) * (p.ndim - 1))
                adam_update_(
                    p, grads[name], m, v, count, lr=self.lr, betas=self.betas, eps=self.eps
                )
                if rows is not None:
                    self.exp_avg[name][rows] = m
                    self.exp_avg_sq[name][rows] = v

    def write_back(self) -> None:
        """Each optimizer's state into its generator's :class:`Adam`."""
        for index, local in enumerate(self._generators):
            optimizer = local.optimizer
            for i, name in enumerate(self.names):
                device = optimizer.params[i].device
                optimizer.exp_avg[i] = self.exp_avg[name][index].detach().to(device).clone()
                optimizer.exp_avg_sq[i] = self.exp_avg_sq[name][index].detach().to(device).clone()
                optimizer.steps[i] = int(self.step[index])


class _BatchedRound:
    """One chunk of same-key members trained as one batched computation."""

    def __init__(self, prepared: Sequence[_Prepared], device: torch.device) -> None:
        self.prepared = list(prepared)
        self.device = device
        first = prepared[0]
        self.config = first.config
        self.model = first.member.model
        self.models = [p.member.model for p in prepared]
        named = list(self.model.named_parameters())
        self.trainable = [n for n, p in named if p.requires_grad]
        constant = [n for n, p in named if not p.requires_grad]
        constant += [n for n, _ in self.model.named_buffers()]
        self.params = _stacked(self.models, self.trainable, device)
        self.constants = _stacked(self.models, constant, device)
        self.momentum = (
            {n: torch.zeros_like(v) for n, v in self.params.items()}
            if self.config.momentum > 0
            else {}
        )
        self.anchor: Tensors = {}
        if first.proximal is not None:
            hooks = [p.proximal for p in prepared]
            self.anchor = {
                n: _stack([h.anchor[n] for h in hooks if h is not None], device)
                for n in first.proximal.anchor
            }
        self.kf: _FedKFState | None = None
        if first.fedkf is not None:
            self.kf = _FedKFState([p.fedkf for p in prepared if p.fedkf is not None], device)
        self.data = [
            (
                as_tensor(p.member.data.x, torch.float32),
                as_tensor(p.member.data.y, torch.int64),
            )
            for p in prepared
        ]
        self.batches = []
        for p, (_, ys) in zip(prepared, self.data, strict=True):
            n = int(ys.shape[0])
            self.batches.append(list(batch_indices(n, p.config, p.config.total_steps(n))))
        count = len(prepared)
        self.loss_sum = torch.zeros(count, dtype=torch.float64, device=device)
        self.correct = torch.zeros(count, dtype=torch.float64, device=device)
        self.kd_sum = torch.zeros(count, dtype=torch.float64, device=device)
        self.gen_sum = torch.zeros(count, dtype=torch.float64, device=device)
        self.ce_sum = torch.zeros(count, dtype=torch.float64, device=device)
        self.seen = [0] * count
        self.steps = [0] * count

    # -- the loss of one device, as vmap sees it --------------------------------------

    def _loss(
        self, point: Tensors, constants: Tensors, extra: Tensors
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """One device's loss at ``point`` (its trainable weights, or their fake-quantized
        values) on its batch ``extra["x"]`` / ``"y"`` / ``"mask"`` (1: a real sample), with
        the strategy's terms from the other entries of ``extra``."""
        cfg = self.config
        x, y, mask = extra["x"], extra["y"], extra["mask"]
        full = point | constants
        logits = functional_call(self.model, full, (x,))  # (B, classes)
        ce = F.cross_entropy(logits, y, reduction="none")  # (B,)
        data_loss = (ce * mask).sum() / mask.sum()
        correct = ((logits.argmax(dim=1) == y).to(mask.dtype) * mask).sum()
        total = data_loss
        kd = ce_g = torch.zeros((), device=x.device)
        if self.anchor:
            total = total + proximal_term(point, _sub(extra, "anchor."), cfg.mu)
        if "images" in extra:
            student = functional_call(self.model, full, (extra["images"],))
            kd = distillation_kl(extra["teacher_logits"], student)
            total = total + cfg.gamma * kd
        if "latents" in extra:
            head = functional_call(self.model.head, _sub(full, HEAD_PREFIX), (extra["latents"],))
            ce_g = F.cross_entropy(head, extra["labels"])
            total = total + cfg.generative_alpha * ce_g
        return total, (data_loss.detach(), correct.detach(), kd.detach(), ce_g.detach())

    # -- the round --------------------------------------------------------------------

    def run(self) -> list[LocalResult]:
        start = time.perf_counter()
        longest = max((len(b) for b in self.batches), default=0)
        loss_and_grad = vmap(grad(self._loss, has_aux=True))
        for step in range(longest):
            active = [i for i, b in enumerate(self.batches) if step < len(b)]
            for rows in self._groups(active, step):
                self._step(loss_and_grad, rows, step)
        _write_back(self.models, self.params | self.constants)
        if self.kf is not None:
            self.kf.write_back()
        seconds = (time.perf_counter() - start) / len(self.prepared)
        return [self._result(i, seconds) for i in range(len(self.prepared))]

    def _groups(self, active: list[int], step: int) -> list[list[int]]:
        """The rows that step together: all active ones (short batches padded), or by
        batch size for FedKF (its generator's BatchNorm sees the whole batch)."""
        if self.kf is None:
            return [active] if active else []
        by_size: dict[int, list[int]] = {}
        for i in active:
            by_size.setdefault(len(self.batches[i][step]), []).append(i)
        return list(by_size.values())

    def _step(self, loss_and_grad: Any, rows: list[int], step: int) -> None:
        every = len(rows) == len(self.prepared)
        index = None if every else torch.tensor(rows, device=self.device)
        sizes = [len(self.batches[i][step]) for i in rows]
        width = max(sizes)
        x0, _ = self.data[rows[0]]
        x = torch.zeros((len(rows), width, *x0.shape[1:]), dtype=torch.float32)
        y = torch.zeros((len(rows), width), dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.float32)
        for j, i in enumerate(rows):
            idx = self.batches[i][step]
            xs, ys = self.data[i]
            x[j, : len(idx)] = xs[idx]
            y[j, : len(idx)] = ys[idx]
            mask[j, : len(idx)] = 1.0
        x, y, mask = (t.to(self.device) for t in (x, y, mask))

        params, constants = _rows(index, self.params), _rows(index, self.constants)
        extra: Tensors = {"x": x, "y": y, "mask": mask}
        extra |= {f"anchor.{k}": v for k, v in _rows(index, self.anchor).items()}
        if self.kf is not None:
            extra |= self.kf.step(rows, index, width)
        if self.prepared[0].fedgen is not None and self.config.generative_alpha != 0:
            extra |= self._latents(rows)
        point = params
        run_value = fake_quantize_int8 if self.config.qat else binarize
        if self.config.qat or self.config.binarize:  # the STE: grads at Q(w), applied to w
            point = {k: vmap(run_value)(v) if v.ndim >= 3 else v for k, v in params.items()}
        grads, (data_loss, correct, kd, ce_g) = loss_and_grad(point, constants, extra)
        self._sgd(params, grads, index)
        batch = torch.tensor(sizes, dtype=torch.float64, device=self.device)
        rows_t = torch.tensor(rows, device=self.device)
        self.loss_sum.index_add_(0, rows_t, data_loss.double() * batch)
        self.correct.index_add_(0, rows_t, correct.double())
        self.kd_sum.index_add_(0, rows_t, kd.double())
        self.ce_sum.index_add_(0, rows_t, ce_g.double())
        for j, i in enumerate(rows):
            self.seen[i] += sizes[j]
            self.steps[i] += 1

    def _latents(self, rows: list[int]) -> Tensors:
        """Each row's next FedGen latents and labels, from its own hook's noise."""
        drawn = []
        for i in rows:
            hook = self.prepared[i].fedgen
            assert hook is not None
            drawn.append(hook.sample_latents(torch.device("cpu")))
        return {
            "latents": torch.stack([d[0] for d in drawn]).to(self.device),
            "labels": torch.stack([d[1] for d in drawn]).to(self.device),
        }

    def _sgd(self, params: Tensors, grads: Tensors, index: torch.Tensor | None) -> None:
        """Each row's SGD step (:func:`sgd_update_`); ``index``: the rows that step
        (None: all), whose gathered ``params`` are written back."""
        cfg = self.config
        with torch.no_grad():
            for name in self.trainable:
                p = params[name]
                buf = None
                if self.momentum:
                    buf = self.momentum[name] if index is None else self.momentum[name][index]
                sgd_update_(
                    p,
                    grads[name],
                    buf,
                    lr=cfg.lr,
                    momentum=cfg.momentum,
                    weight_decay=cfg.weight_decay,
                )
                if cfg.binarize and p.ndim >= 3:  # a weight of rank >= 2, stacked
                    clip_latent_(p)
                if index is not None:
                    self.params[name][index] = p
                    if buf is not None:
                        self.momentum[name][index] = buf

    def _result(self, i: int, seconds: float) -> LocalResult:
        prepared = self.prepared[i]
        seen, steps = self.seen[i], self.steps[i]
        metrics: dict[str, float] = {}
        if steps:
            if prepared.fedkf is not None and self.kf is not None:
                metrics["kd_loss"] = float(self.kd_sum[i]) / steps
                metrics["generator_loss"] = float(self.kf.loss_sum[i]) / steps
            if prepared.fedgen is not None and self.config.generative_alpha != 0:
                metrics["generator_ce"] = float(self.ce_sum[i]) / steps
        metrics["loss"] = float(self.loss_sum[i]) / seen if seen else 0.0
        metrics["accuracy"] = float(self.correct[i]) / seen if seen else 0.0
        return local_result(
            prepared.member.model,
            prepared.member.task,
            num_samples=int(self.data[i][1].shape[0]),
            metrics=metrics,
            timings={"load_s": prepared.load_s, "train_s": seconds},
            steps=steps,
        )


class _FedKFState:
    """The stacked side of FedKF's T2: each device's image generator (its own Adam
    state) and its frozen teacher."""

    def __init__(self, hooks: Sequence[FedKFHook], device: torch.device) -> None:
        self.hooks = list(hooks)
        self.device = device
        generators = [h.generator for h in hooks if h.generator is not None]
        self.generators = generators
        self.module = generators[0].module
        self.teacher = hooks[0].teacher
        self.config = hooks[0].config
        modules = [g.module for g in generators]
        self.param_names = [n for n, _ in self.module.named_parameters()]
        self.buffer_names = [n for n, _ in self.module.named_buffers()]
        self.params = _stacked(modules, self.param_names, device)
        self.buffers = _stacked(modules, self.buffer_names, device)
        teacher_names = [n for n, _ in self.teacher.named_parameters()]
        teacher_names += [n for n, _ in self.teacher.named_buffers()]
        self.teachers = _stacked([h.teacher for h in hooks], teacher_names, device)
        self.adam = _StackedAdam(generators, device)
        self.loss_sum = torch.zeros(len(hooks), dtype=torch.float64, device=device)
        self.module.train()
        cfg = self.config

        def objective(
            params: Tensors, buffers: Tensors, teacher: Tensors, z: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            images = functional_call(self.module, params | buffers, (z,))
            features = functional_call(
                self.teacher.features, _sub(teacher, FEATURES_PREFIX), (images,)
            )
            logits = functional_call(self.teacher.head, _sub(teacher, HEAD_PREFIX), (features,))
            total, *_ = fedkf_generator_objective(logits, features, cfg.lambda1, cfg.lambda2)
            return total, total.detach()

        self._grad = vmap(grad(objective, has_aux=True))

        def sample(params: Tensors, buffers: Tensors, z: torch.Tensor) -> torch.Tensor:
            return functional_call(self.module, params | buffers, (z,))  # type: ignore[no-any-return]

        def teach(teacher: Tensors, images: torch.Tensor) -> torch.Tensor:
            return functional_call(self.teacher, teacher, (images,))  # type: ignore[no-any-return]

        self._sample = vmap(sample)
        self._teach = vmap(teach)

    def step(self, rows: list[int], index: torch.Tensor | None, width: int) -> Tensors:
        """One Adam step of each row's generator, then each row's generated batch and
        its teacher's logits (rows of one batch size ``width``)."""
        z, z_sample = [], []
        for i in rows:  # per device: the step's noise, then the sample's
            noise = self.hooks[i].noise
            z.append(torch.randn(width, self.module.noise_dim, generator=noise))
            z_sample.append(torch.randn(width, self.module.noise_dim, generator=noise))
        zs = torch.stack(z).to(self.device)
        zs_sample = torch.stack(z_sample).to(self.device)

        params = _rows(index, self.params)
        buffers, teachers = _rows(index, self.buffers), _rows(index, self.teachers)
        grads, loss = self._grad(params, buffers, teachers, zs)
        self.adam.update(params, grads, index)
        with torch.no_grad():
            images = self._sample(params, buffers, zs_sample)
            teacher_logits = self._teach(teachers, images)
        if index is not None:
            for name, value in params.items():
                self.params[name][index] = value
            for name, value in buffers.items():
                self.buffers[name][index] = value
        rows_t = torch.tensor(rows, device=self.device)
        self.loss_sum.index_add_(0, rows_t, loss.double())
        return {"images": images, "teacher_logits": teacher_logits}

    def write_back(self) -> None:
        _write_back([g.module for g in self.generators], self.params | self.buffers)
        self.adam.write_back()
