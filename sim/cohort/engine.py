"""The batched cohort engine: many emulated devices' local training as one computation.

:func:`train_cohort` runs the round of every device of a cohort that shares an
architecture, a strategy and its hyperparameters (all but the shuffling seed) as one
batched computation: the devices' parameters are stacked along a leading device axis, a
:class:`~models.stacked.StackedModule` of the architecture runs every device's batch
with its own weights at once, the gradient of the sum of the devices' losses gives each
device its own gradient (row ``i`` depends on device ``i``'s loss alone), and the
optimizer steps act on the stacked tensors (SGD with momentum and weight decay:
elementwise, so exactly N independent optimizers). Nothing of it imports torch's
compiler (``torch.func.vmap`` does, seconds of stall on the first round).

The devices' samples are one tensor on the training device, and each device's batches
rows of one index tensor, both built once per chunk: a step's batches are one gather.

It computes what the per-device reference,
:func:`edge_client.train.local_update.local_update`, computes, with the same pieces:

* each device's batches come from :func:`~edge_client.train.training.batch_indices` with
  its own seed; a device with fewer batches than the longest takes no step (and its
  momentum does not move) once it is done; a short last batch is padded and masked out
  of the loss (its mean is over the real samples, as the loop's is). The classifiers
  normalise per sample (GroupNorm or none), so padding changes nothing else, and a
  term's own inputs (FedKF's generated batches) have a size of their own, not the data
  batch's;
* the strategy prepares each device as the loop does
  (:meth:`~edge_client.train.strategies.strategy.DeviceStrategy.prepare`: received sets
  loaded, hooks built) and each hook's term of the loss is its batched form
  (:meth:`~edge_client.train.batched.BatchedHook.stack`, defined with the hook in the
  strategy's module): the engine knows no strategy. int8 QAT and binarized weights are
  the straight-through estimator (the gradient is taken at
  :func:`~models.weight_formats.fake_quantize_int8` or
  :func:`~models.weight_formats.binarize` of the weights and applied to the float
  weights; binarized ones are then clipped by
  :func:`~edge_client.train.binary.clip_latent_`);
* head-only sharing and uploads, and the uplink's error feedback (in each device's
  transfer state, after training), are per device as in the loop.

Same seeds, data and hyperparameters give the loop's updates within float tolerance
(tests/sim/cohort bound the largest difference per strategy). A device the engine cannot
batch (a layer without a stacked form, a hook without a batched form, or one that says
it cannot be batched) trains on the per-device path and the outcome says why.

Pure: models, data and tasks in, results out (the members' models and learning states
are updated as the loop would update them); no I/O, no global RNG.
"""

from __future__ import annotations

import time
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from edge_client.errors import TaskError
from edge_client.train.batched import (
    BatchedHook,
    StackedTerm,
    Tensors,
    select_rows,
    stacked,
    write_back,
)
from edge_client.train.binary import clip_latent_
from edge_client.train.data import DeviceData
from edge_client.train.local_update import train_prepared, validate_task
from edge_client.train.strategies import device_strategy
from edge_client.train.task import LocalResult, LocalTask, local_result
from edge_client.train.training import TrainConfig, TrainHook, as_tensor, batch_indices
from models import Classifier
from models.optim import sgd_update_
from models.stacked import StackedModule
from models.weight_formats import binarize, fake_quantize_int8
from sim.cohort.resident import Resident, ResidentWeights

__all__ = ["CohortOutcome", "Member", "SampleCache", "train_cohort"]


@dataclass
class Member:
    """One device of a cohort: what :func:`~edge_client.train.local_update.local_update`
    would be called with."""

    model: Classifier
    """The device's classifier, trained in place."""
    data: DeviceData
    """The device's local data."""
    task: LocalTask
    """The round's task, decoded."""
    state: MutableMapping[str, Any] = field(default_factory=dict)
    """The device's learning state across rounds (what its strategy keeps there)."""


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
    batched: tuple[BatchedHook, ...] = ()
    """:attr:`hooks`, each with its batched form (empty when :attr:`fallback_reason`)."""
    fallback_reason: str = ""
    """Why the member cannot be batched, or ""."""


def _batched_hooks(hooks: Sequence[TrainHook]) -> tuple[tuple[BatchedHook, ...], str]:
    """``hooks`` as hooks with a batched form, or () and why one of them cannot be."""
    batched: list[BatchedHook] = []
    for hook in hooks:
        if not isinstance(hook, BatchedHook):
            return (), f"the strategy's hook {type(hook).__name__} has no batched form"
        batched.append(hook)
    for hook in batched:
        reason = hook.unbatchable()
        if reason:
            return (), reason
    return tuple(batched), ""


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
    batched, reason = _batched_hooks(hooks)
    return _Prepared(member, config, tuple(hooks), time.perf_counter() - start, batched, reason)


def train_cohort(
    members: Sequence[Member],
    *,
    device: torch.device = torch.device("cpu"),  # noqa: B008
    max_cohort: int | None = None,
    progress: Callable[[int], None] | None = None,
    samples: SampleCache | None = None,
    on_step: Callable[[int, int], None] | None = None,
    resident: ResidentWeights | None = None,
) -> list[CohortOutcome]:
    """Train every member's round; batched where members share a batch key.

    Args:
        members: the devices and their tasks.
        device: where to compute (the members' models stay where they are; their new
            weights are copied back).
        max_cohort: most devices in one batched computation (None: no limit); larger
            cohorts are trained in chunks.
        progress: called with the number of members finished after each chunk.
        samples: keeps each chunk's samples on ``device`` from one call to the next
            (a fleet whose chunks recur trains on resident data: with it, a group's
            members are chunked in an order of their data, not of ``members``, so
            that the same devices make the same chunks whatever order their tasks
            came in); None: built per call.
        on_step: called after each local step of a batched computation with the steps
            done and the steps it takes (its longest device's), so that a long round
            shows how far it is before any of its devices is done.
        resident: keeps the members' parameters stacked between calls (the models'
            parameters become views of its rows): a group's members are then chunked
            in the order of their rows, and a chunk of consecutive rows trains in place,
            with nothing stacked or written back; None: stacked and written back per
            chunk.

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
        if prepared.fallback_reason:
            outcomes[index] = _run_loop(prepared, device, prepared.fallback_reason)
            if progress is not None:
                progress(1)
            continue
        groups.setdefault(_batch_key(prepared), []).append((index, prepared))
    for group in groups.values():
        architecture = StackedModule(group[0][1].member.model)
        if architecture.unstackable:
            reason = f"the model cannot be batched: {architecture.unstackable}"
            for index, prepared in group:
                outcomes[index] = _run_loop(prepared, device, reason)
            if progress is not None:
                progress(len(group))
            continue
        size = max_cohort or len(group)
        chunks: list[tuple[list[tuple[int, _Prepared]], Resident | None]]
        if resident is not None:  # the same devices in the same chunks: rows in order
            placed = resident.place([p.member.model for _, p in group])
            stacks = [id(stack) for stack, _ in placed]
            order = sorted(range(len(group)), key=lambda k: (stacks[k], placed[k][1]))
            chunks = [
                (
                    [group[k] for k in ks],
                    Resident(placed[ks[0]][0], tuple(placed[k][1] for k in ks)),
                )
                for ks in _cut(order, size, stacks)
            ]
        else:
            if samples is not None:  # the same devices in the same chunks each round
                group.sort(key=lambda member: id(member[1].member.data))
            chunks = [(group[k : k + size], None) for k in range(0, len(group), size)]
        for chunk, rows in chunks:
            members_of = [p for _, p in chunk]
            cache = samples if samples is not None else SampleCache()
            data = cache.get([p.member.data for p in members_of], device)
            trained = _BatchedRound(members_of, device, architecture, data, rows)
            results = trained.run(on_step)
            for (index, _), result in zip(chunk, results, strict=True):
                outcomes[index] = CohortOutcome(result)
            if progress is not None:
                progress(len(chunk))
    if samples is not None:
        samples.forget_unused()
    return [o if o is not None else CohortOutcome(None, RuntimeError("lost")) for o in outcomes]


def _cut(order: list[int], size: int, keys: Sequence[object]) -> list[list[int]]:
    """``order`` in runs of at most ``size`` items of one key (``keys[k]``: item k's)."""
    runs: list[list[int]] = []
    for k in order:
        if not runs or len(runs[-1]) == size or keys[runs[-1][0]] != keys[k]:
            runs.append([])
        runs[-1].append(k)
    return runs


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


class _BatchedRound:
    """One chunk of same-key members trained as one batched computation."""

    def __init__(
        self,
        prepared: Sequence[_Prepared],
        device: torch.device,
        architecture: StackedModule,
        data: _Concatenated,
        resident: Resident | None = None,
    ) -> None:
        self.prepared = list(prepared)
        self.device = device
        first = prepared[0]
        self.config = first.config
        self.model = first.member.model
        self.stacked = architecture.train()
        self.models = [p.member.model for p in prepared]
        named = list(self.model.named_parameters())
        self.trainable = [n for n, p in named if p.requires_grad]
        constant = [n for n, p in named if not p.requires_grad]
        buffers = [n for n, _ in self.model.named_buffers()]
        self.resident = resident
        self.in_place = False
        if resident is None:
            self.params = stacked(self.models, self.trainable, device)
            self.constants = stacked(self.models, constant + buffers, device)
        else:
            self.params, self.in_place = resident.take(self.trainable, device)
            fixed, _ = resident.take(constant, device)
            self.constants = fixed | (stacked(self.models, buffers, device) if buffers else {})
            self.buffers = buffers
        self.momentum = (
            {n: torch.zeros_like(v) for n, v in self.params.items()}
            if self.config.momentum > 0
            else {}
        )
        # the same hook types in the same order for every member (see _batch_key)
        self.terms: list[StackedTerm] = [
            type(hook).stack([p.batched[j] for p in prepared], device)
            for j, hook in enumerate(first.batched)
        ]
        self.samples = _CohortSamples(data, [p.config for p in prepared], device)
        count = len(prepared)
        self.loss_sum = torch.zeros(count, dtype=torch.float64, device=device)
        self.correct = torch.zeros(count, dtype=torch.float64, device=device)

    # -- the loss of the devices that step --------------------------------------------

    def _loss(
        self, point: Tensors, constants: Tensors, batch: _Batch, extra: list[Tensors]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The summed loss of the stepping devices at ``point`` (their trainable weights,
        or the fake-quantized values) on their batches (``batch.mask`` 1: a real
        sample), plus each term's with its inputs ``extra[j]``; and per device (n,): the
        data loss, the correct predictions and each term's measured value."""
        full = point | constants
        logits = self.stacked(full, batch.x)  # (n, B, classes)
        ce = F.cross_entropy(logits.flatten(0, 1), batch.y.flatten(), reduction="none")
        ce = ce.view(batch.mask.shape)
        data_loss = (ce * batch.mask).sum(dim=1) / batch.mask.sum(dim=1)  # (n,)
        hits = (logits.argmax(dim=2) == batch.y).to(batch.mask.dtype)
        correct = (hits * batch.mask).sum(dim=1)
        total = data_loss
        measured = []
        for term, inputs in zip(self.terms, extra, strict=True):
            value, seen = term.loss(self.stacked, point, full, inputs)
            total = total + value
            measured.append(seen)
        return total.sum(), data_loss.detach(), correct.detach(), measured

    # -- the round --------------------------------------------------------------------

    def run(self, on_step: Callable[[int, int], None] | None = None) -> list[LocalResult]:
        start = time.perf_counter()
        longest = self.samples.longest
        for step in range(longest):
            rows = self.samples.active(step)
            if rows:
                self._step(rows, step)
            if on_step is not None:
                on_step(step + 1, longest)
        if self.resident is None:
            write_back(self.models, self.params | self.constants)
        else:  # the parameters are the models' rows; buffers are the models' own
            if not self.in_place:
                self.resident.put(self.params)
            if self.buffers:
                write_back(self.models, {n: self.constants[n] for n in self.buffers})
        for term in self.terms:
            term.write_back()
        seconds = (time.perf_counter() - start) / len(self.prepared)
        return [self._result(i, seconds) for i in range(len(self.prepared))]

    def _step(self, rows: list[int], step: int) -> None:
        every = len(rows) == len(self.prepared)
        index = None if every else torch.tensor(rows, device=self.device)
        batch = self.samples.batch(rows, index, step)
        params = select_rows(index, self.params)
        constants = select_rows(index, self.constants)
        width = int(batch.x.shape[1])
        extra = [term.inputs(rows, index, width) for term in self.terms]
        if self.config.qat or self.config.binarize:  # the STE: grads at Q(w), applied to w
            run_value = fake_quantize_int8 if self.config.qat else binarize
            point = {k: _per_row(run_value, v) if v.ndim >= 3 else v for k, v in params.items()}
        else:
            point = params
        leaves = {k: v.detach().requires_grad_() for k, v in point.items()}
        with torch.enable_grad():
            total, data_loss, correct, measured = self._loss(leaves, constants, batch, extra)
            names = list(leaves)
            found = torch.autograd.grad(total, [leaves[k] for k in names]) if names else ()
            grads = dict(zip(names, found, strict=True))
        self._sgd(params, grads, index)
        rows_t = torch.arange(len(rows), device=self.device) if index is None else index
        self.loss_sum.index_add_(0, rows_t, data_loss.double() * batch.sizes)
        self.correct.index_add_(0, rows_t, correct.double())
        for term, values in zip(self.terms, measured, strict=True):
            term.record(rows_t, values)

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
        seen, steps = self.samples.seen[i], self.samples.steps[i]
        metrics: dict[str, float] = {}
        if steps:
            for term in self.terms:
                metrics.update(term.metrics(i, steps))
        metrics["loss"] = float(self.loss_sum[i]) / seen if seen else 0.0
        metrics["accuracy"] = float(self.correct[i]) / seen if seen else 0.0
        return local_result(
            prepared.member.model,
            prepared.member.task,
            num_samples=prepared.member.data.num_samples,
            metrics=metrics,
            timings={"load_s": prepared.load_s, "train_s": seconds},
            steps=steps,
        )


def _per_row(function: Callable[[torch.Tensor], torch.Tensor], value: torch.Tensor) -> torch.Tensor:
    """A per-output-channel weight function (axis 0) of each row of a stacked weight
    (N, C, ...): the rows' channels are channels of one (N * C, ...) tensor."""
    return function(value.reshape(-1, *value.shape[2:])).reshape(value.shape)


@dataclass(frozen=True)
class _Batch:
    """One step's batches of the devices that step, padded to one width."""

    x: torch.Tensor
    """Samples (n, B, ...)."""
    y: torch.Tensor
    """Labels (n, B)."""
    mask: torch.Tensor
    """1.0 for a real sample, 0.0 for padding (n, B)."""
    sizes: torch.Tensor
    """Real samples per device (n,), float64."""


class _CohortSamples:
    """The training samples of a chunk's devices as one tensor on the training device,
    and each device's batches as rows of one index tensor: a step's batches are one
    gather, whatever the number of devices.

    Each device's batches are :func:`~edge_client.train.training.batch_indices` with
    its own config's seed (the loop's batches); a device with fewer batches than the
    longest takes no step once it is done.
    """

    def __init__(
        self, data: _Concatenated, configs: Sequence[TrainConfig], device: torch.device
    ) -> None:
        self.x, self.y = data.x, data.y
        counts, offsets = data.counts, data.offsets
        batches = [
            list(batch_indices(n, config, config.total_steps(n))) if n else []
            for n, config in zip(counts, configs, strict=True)
        ]
        self.steps = [len(b) for b in batches]
        self.seen = [sum(len(i) for i in b) for b in batches]
        self.longest = max(self.steps, default=0)
        width = max((len(i) for b in batches for i in b), default=1)
        rows = len(counts)
        # (devices, steps, width): sample numbers into self.x; -1 pads
        index = torch.full((rows, max(1, self.longest), width), -1, dtype=torch.int64)
        self._sizes = torch.zeros((rows, max(1, self.longest)), dtype=torch.int64)
        for row, (offset, device_batches) in enumerate(zip(offsets, batches, strict=True)):
            for step, idx in enumerate(device_batches):
                index[row, step, : len(idx)] = idx + offset
                self._sizes[row, step] = len(idx)
        self.index = index.to(device)
        self.device = device

    def active(self, step: int) -> list[int]:
        """The devices that take step ``step``."""
        return [i for i, steps in enumerate(self.steps) if step < steps]

    def batch_size(self, row: int, step: int) -> int:
        """The samples of device ``row``'s batch at ``step``."""
        return int(self._sizes[row, step])

    def batch(self, rows: list[int], index: torch.Tensor | None, step: int) -> _Batch:
        """The batches of devices ``rows`` (``index`` on the device; None: all) at
        ``step``, padded to the widest of them."""
        width = max(self.batch_size(i, step) for i in rows)
        picked = self.index[:, step, :width] if index is None else self.index[index, step, :width]
        mask = picked >= 0
        safe = picked.clamp_min(0)
        sizes = torch.tensor([self.batch_size(i, step) for i in rows], dtype=torch.float64)
        return _Batch(
            # gathered sample-major, as the stacked module runs it: no copy there
            x=self.x[safe.T].transpose(0, 1),
            y=self.y[safe],
            mask=mask.to(torch.float32),
            sizes=sizes.to(self.device),
        )


@dataclass(frozen=True)
class _Concatenated:
    """A chunk's devices' samples, one after the other, on the training device."""

    x: torch.Tensor
    y: torch.Tensor
    counts: list[int]
    """Samples per device, in row order."""
    offsets: list[int]
    """Where each device's samples start in :attr:`x`."""

    @classmethod
    def of(cls, datas: Sequence[DeviceData], device: torch.device) -> _Concatenated:
        counts = [d.num_samples for d in datas]
        offsets = [0]
        for count in counts[:-1]:
            offsets.append(offsets[-1] + count)
        x = torch.cat([as_tensor(d.x, torch.float32) for d in datas]).to(device)
        y = torch.cat([as_tensor(d.y, torch.int64) for d in datas]).to(device)
        return cls(x, y, counts, offsets)


class SampleCache:
    """The chunks' samples kept on the training device between rounds.

    A chunk is known by its devices' data objects, in order; the chunks not used by a
    call of :func:`train_cohort` are dropped at its end, so what stays is the last
    round's (a fleet whose devices all train every round keeps its data resident, and
    one whose cohort changes holds no more than one round's).
    """

    def __init__(self) -> None:
        self._chunks: dict[tuple[object, ...], tuple[list[DeviceData], _Concatenated]] = {}
        self._used: set[tuple[object, ...]] = set()

    def get(self, datas: Sequence[DeviceData], device: torch.device) -> _Concatenated:
        """The samples of ``datas`` on ``device``, built once."""
        key = (str(device), *(id(d) for d in datas))
        found = self._chunks.get(key)
        if found is None:
            # the data objects are held with the chunk: their ids stay theirs
            found = (list(datas), _Concatenated.of(datas, device))
            self._chunks[key] = found
        self._used.add(key)
        return found[1]

    def forget_unused(self) -> None:
        """Drop the chunks not used since the last call."""
        for key in set(self._chunks) - self._used:
            del self._chunks[key]
        self._used = set()
