"""Memory budget check at start: will local training fit in the memory this process has?

The edge client runs unattended on small boards (Raspberry Pi, Jetson) under systemd,
usually with ``MemoryMax=`` on its unit. Running out of memory there means the kernel's
OOM killer ends the process in the middle of a round, and systemd restarts it into the
same round again. :func:`check_memory` refuses to start instead, with one line that says
how much is needed, how much there is and where that limit comes from.

- :func:`memory_limit` is what this process may still grow to: the smaller of its cgroup
  limit (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``, the smallest along the path
  to the root) and its current RSS plus the kernel's ``MemAvailable``.
- :func:`estimate_training` counts the bytes one training step needs for a model and a
  batch size, from one forward pass of a single sample (the activations grow linearly
  in the batch), so it is fast, allocates nothing proportional to the batch and leaves
  the model as it was.
- :func:`check_memory` compares current RSS + the estimate with the limit and raises
  :class:`ResourceError` when it does not fit.

Reading the limit never fails: on another OS, or where the files cannot be read, the
limit is "none" (:data:`NO_LIMIT` bytes).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from edge_client.errors import EdgeClientError
from edge_client.link import rss_bytes

__all__ = [
    "NO_LIMIT",
    "MemoryEstimate",
    "MemoryLimit",
    "ResourceError",
    "check_memory",
    "current_rss",
    "estimate_training",
    "memory_limit",
]

logger = logging.getLogger(__name__)

NO_LIMIT = sys.maxsize
"""The limit, in bytes, reported when no limit is known (source ``"none"``)."""

FLOAT32_BYTES = 4

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")

# cgroup v1 reports "no limit" as PAGE_COUNTER_MAX pages: LONG_MAX rounded down to a
# multiple of the page size (9223372036854771712 with 4 KiB pages). Anything within
# 64 KiB (the largest page size) of LONG_MAX is that sentinel; 2**62 bytes is no real
# limit either. A 32-bit Python on a 64-bit kernel sees the 64-bit sentinel, above both.
_V1_UNLIMITED_FROM = min(2**62, sys.maxsize - 0xFFFF)

_MIB = 1024 * 1024


class ResourceError(EdgeClientError, ValueError):
    """Training would not fit in the memory this process may use, or cannot be estimated.

    The message is one line: what is needed (current RSS and each part of the
    estimate), the limit and where it comes from, and what to change.
    """


@dataclass(frozen=True)
class MemoryLimit:
    """How far this process may grow, in bytes, and where that number comes from."""

    bytes: int
    """The limit in bytes (:data:`NO_LIMIT` when none is known)."""
    source: str
    """``"cgroup memory.max (/sys/fs/cgroup/.../memory.max)"``, ``"cgroup
    memory.limit_in_bytes (...)"`` (cgroup v1), ``"MemAvailable"`` (current RSS plus
    /proc/meminfo's MemAvailable), ``"budget"`` (given by the caller) or ``"none"``."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one local training step needs, by part; all counted as float32.

    ``total`` is the sum of the parts. Memory the process already holds (the Python
    runtime, torch, the data set) is not part of it: that is the current RSS, which
    :func:`check_memory` adds.
    """

    model: str
    """Name of the model (a classifier's registry name, else its class name)."""
    batch_size: int
    """Samples per mini-batch the estimate is for."""
    parameters: int
    """The model's weights and floating-point buffers."""
    gradients: int
    """One gradient per trainable parameter."""
    optimizer: int
    """Optimizer state: one slot per trainable parameter per state (SGD momentum)."""
    activations: int
    """Outputs of every leaf module for the batch, twice: saved for backward and their
    gradients."""
    model_copies: int
    """Extra copies of the weights: received models, the held base, the error-feedback
    residual."""
    total: int = field(init=False)
    """Sum of the parts above."""

    def __post_init__(self) -> None:
        total = (
            self.parameters + self.gradients + self.optimizer + self.activations + self.model_copies
        )
        object.__setattr__(self, "total", total)

    def parts(self) -> str:
        """The parts as ``"parameters 0.24 MiB, gradients 0.24 MiB, ..."``."""
        return ", ".join(
            f"{label} {_mib(value)}"
            for label, value in (
                ("parameters", self.parameters),
                ("gradients", self.gradients),
                ("optimizer", self.optimizer),
                ("model copies", self.model_copies),
                ("activations", self.activations),
            )
        )

    def describe(self) -> str:
        """One line, e.g. ``"lenet5 training at batch 64: about 8.8 MiB (parameters ...)"``."""
        return (
            f"{self.model} training at batch {self.batch_size}: "
            f"about {_mib(self.total)} ({self.parts()})"
        )


# --------------------------------------------------------------------------- limits


def current_rss(*, proc: Path = PROC) -> int:
    """Resident set size of this process now, in bytes.

    Read from ``/proc/self/statm``; where that cannot be read, the peak RSS from
    ``resource.getrusage`` (an over-estimate of the current one); 0 where neither exists.
    """
    resident = rss_bytes(proc=proc)
    if resident is not None:
        return resident
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def memory_limit(*, proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> MemoryLimit:
    """What this process may still grow to: the smallest of its limits, with the source.

    The candidates are

    - the cgroup limit of this process: the cgroup named in ``/proc/self/cgroup``, then
      its ``memory.max`` (cgroup v2; ``max`` is no limit) or
      ``memory/<path>/memory.limit_in_bytes`` (cgroup v1; the huge "unlimited" value is
      no limit), walking up to the root and taking the smallest limit found;
    - the current RSS plus ``MemAvailable`` from ``/proc/meminfo`` (source
      ``"MemAvailable"``).

    A cgroup limit is shared by every process of the cgroup (for a systemd service,
    usually just this one). Never raises: without any readable source (another OS,
    missing or unreadable files) the result is ``MemoryLimit(NO_LIMIT, "none")``.

    Args:
        proc: the procfs mount (tests pass a fake tree).
        cgroup_root: the cgroup filesystem mount (v2 unified, or the parent of the v1
            ``memory`` controller directory).
    """
    candidates: list[MemoryLimit] = []
    try:
        candidates.extend(_cgroup_limits(proc, cgroup_root))
        available = _mem_available(proc)
        if available is not None:
            candidates.append(MemoryLimit(current_rss(proc=proc) + available, "MemAvailable"))
    except Exception:  # never let a strange /proc or /sys stop the client
        logger.debug("cannot read the memory limit", exc_info=True)
    if not candidates:
        return MemoryLimit(NO_LIMIT, "none")
    return min(candidates, key=lambda limit: limit.bytes)  # first (cgroup) on a tie


def _mem_available(proc: Path) -> int | None:
    try:
        text = (proc / "meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "MemAvailable":
            fields = value.split()
            try:
                amount = int(fields[0])
            except (ValueError, IndexError):
                return None
            unit = fields[1].lower() if len(fields) > 1 else ""
            return amount * 1024 if unit == "kb" else amount
    return None  # kernels before 3.14 do not have it


def _cgroup_limits(proc: Path, cgroup_root: Path) -> list[MemoryLimit]:
    try:
        text = (proc / "self" / "cgroup").read_text()
    except OSError:
        return []
    limits: list[MemoryLimit] = []
    for line in text.splitlines():
        # "hierarchy-id:controller-list:path"; the v2 line is "0::/path".
        hierarchy, sep, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep and sep2):
            continue
        if hierarchy == "0" and not controllers:
            limits.extend(_walk_up(cgroup_root, path, "memory.max", _parse_v2))
        elif "memory" in controllers.split(","):
            limits.extend(
                _walk_up(cgroup_root / "memory", path, "memory.limit_in_bytes", _parse_v1)
            )
    return limits


def _walk_up(
    base: Path, path: str, filename: str, parse: Callable[[str], int | None]
) -> Iterator[MemoryLimit]:
    """Limits in ``filename`` from the cgroup directory of ``path`` up to ``base``."""
    parts = [part for part in path.strip().split("/") if part]
    start = base.joinpath(*parts)
    # Outside our cgroup namespace the path starts with "..", and in a container whose
    # own cgroup is mounted at the root the path does not exist under it: use the root.
    if ".." in parts or not start.is_dir():
        start = base
    directory = start
    while True:
        file = directory / filename
        try:
            value = parse(file.read_text())
        except (OSError, ValueError):
            value = None
        if value is not None:
            yield MemoryLimit(value, f"cgroup {filename} ({file})")
        if directory in (base, directory.parent):  # the mount, or the filesystem root
            return
        directory = directory.parent


def _parse_v2(text: str) -> int | None:
    value = text.strip()
    return None if value == "max" else int(value)


def _parse_v1(text: str) -> int | None:
    value = int(text.strip())
    return None if value < 0 or value >= _V1_UNLIMITED_FROM else value


# ------------------------------------------------------------------------- estimate


def estimate_training(
    model: nn.Module,
    input_shape: tuple[int, ...],
    batch_size: int,
    *,
    model_copies: int = 4,
    optimizer_slots: int = 1,
) -> MemoryEstimate:
    """Estimate the bytes one training step of ``model`` at ``batch_size`` needs.

    Counted in float32 (4 bytes per element):

    - parameters: every parameter and floating-point buffer;
    - gradients: one per trainable parameter;
    - optimizer: ``optimizer_slots`` per trainable parameter (SGD momentum: one);
    - activations: the outputs of every leaf module (one without submodules) for the
      whole batch, counted twice (saved for backward, and their gradients);
    - model copies: ``model_copies`` extra copies of the weights (received models, the
      held base, the error-feedback residual).

    The activations come from one forward pass of a single zero sample through
    ``model`` itself, on its device, without autograd and in eval mode (each module's
    training flag is restored, BatchNorm's running statistics are not updated), times
    ``batch_size`` (exact for leaves that compute each sample on its own, as those of
    every built-in classifier do): nothing proportional to the batch or to the weights is allocated,
    the weights and training state are left as they were, and the global random
    generator is not drawn from. Forward hooks the model already has run on that
    sample too.

    Args:
        model: the model to train (a :class:`~models.classifiers.Classifier` or any
            module taking one ``(B, *input_shape)`` tensor).
        input_shape: shape of one sample, e.g. ``Classifier.input_shape`` ``(C, H, W)``.
        batch_size: samples per mini-batch, >= 1.
        model_copies: extra copies of the weights held during a round, >= 0.
        optimizer_slots: optimizer state tensors per parameter, >= 0.

    Raises:
        ResourceError: an argument is out of range, or the model cannot run a sample of
            ``input_shape`` (the cause is chained).
    """
    if batch_size < 1:
        raise ResourceError(f"batch_size must be at least 1, got {batch_size}")
    if model_copies < 0 or optimizer_slots < 0:
        raise ResourceError(
            f"model_copies and optimizer_slots must be >= 0, got {model_copies} and "
            f"{optimizer_slots}"
        )
    name = str(getattr(model, "architecture", type(model).__name__))
    state = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for b in model.buffers() if b.is_floating_point()
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    outputs = _leaf_output_elements(model, name, tuple(input_shape), batch_size)
    return MemoryEstimate(
        model=name,
        batch_size=batch_size,
        parameters=FLOAT32_BYTES * state,
        gradients=FLOAT32_BYTES * trainable,
        optimizer=FLOAT32_BYTES * trainable * optimizer_slots,
        activations=2 * FLOAT32_BYTES * outputs,
        model_copies=FLOAT32_BYTES * state * model_copies,
    )


def _leaf_output_elements(
    model: nn.Module, name: str, input_shape: tuple[int, ...], batch_size: int
) -> int:
    """Elements of every leaf module's output for ``batch_size`` samples.

    One real forward pass of a single zero sample, on the model's own device and dtype,
    under ``torch.no_grad()`` and in eval mode (so BatchNorm neither uses nor updates
    batch statistics and dropout is off; each module's training flag is restored
    afterwards), counted by forward hooks on the leaves and removed again. The leaves
    of the built-in classifiers (convolutions, linear layers, ReLU, pooling, flatten,
    GroupNorm, identity) all compute each sample on its own, so their outputs grow
    linearly in the batch: the count for one sample times ``batch_size``.

    Why not the ``meta`` device (shapes only, no data): torch runs many meta kernels
    through ``torch._refs``, which imports ``torch._dynamo``, the compiler (about a
    second, tens of MB, far more under a profiler) on the first call.
    """
    total = 0

    def count(_module: nn.Module, _args: object, output: object) -> None:
        nonlocal total
        total += _numel(output)

    modes = [(module, module.training) for module in model.modules()]
    handles = [
        module.register_forward_hook(count)
        for module in model.modules()
        if next(module.children(), None) is None
    ]
    try:
        model.eval()
        device, dtype = _device_and_dtype(model)
        with torch.no_grad():
            model(torch.zeros((1, *input_shape), device=device, dtype=dtype))
    except Exception as exc:
        raise ResourceError(
            f"cannot estimate the activations of {name} for input {input_shape}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes:
            module.training = training
    return total * batch_size


def _device_and_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where the model's floating-point weights live and their dtype (the first found;
    the CPU and float32 for a model without any)."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_floating_point():
            return tensor.device, tensor.dtype
    return torch.device("cpu"), torch.float32


def _numel(output: object) -> int:
    if isinstance(output, torch.Tensor):
        return output.numel()
    if isinstance(output, (tuple, list)):
        return sum(_numel(item) for item in output)
    if isinstance(output, Mapping):
        return sum(_numel(item) for item in output.values())
    return 0


# ---------------------------------------------------------------------------- check


def check_memory(
    estimate: MemoryEstimate,
    *,
    budget_bytes: int | None = None,
    limit: MemoryLimit | None = None,
    rss: int | None = None,
    what: str | None = None,
) -> None:
    """Raise :class:`ResourceError` unless current RSS + ``estimate.total`` fits.

    The current RSS already holds whatever the process has built (possibly the model
    itself), so the check errs on the safe side.

    Args:
        estimate: from :func:`estimate_training`.
        budget_bytes: an explicit budget; wins over ``limit``.
        limit: the limit to check against; :func:`memory_limit` when None.
        rss: current RSS in bytes; :func:`current_rss` when None.
        what: what needs the memory, for the messages; ``"<model> training"`` when None.

    Raises:
        ResourceError: the training would need more than the budget; the one-line
            message names the numbers, the source of the limit and what to change.
    """
    if budget_bytes is not None:
        budget = MemoryLimit(budget_bytes, "budget")
    else:
        budget = limit if limit is not None else memory_limit()
    now = current_rss() if rss is None else rss
    needed = now + estimate.total
    what = f"{estimate.model} training" if what is None else what
    if needed <= budget.bytes:
        logger.debug(
            "memory for %s at batch %d: about %s of %s (%s)",
            what,
            estimate.batch_size,
            _mib(needed),
            "no limit" if budget.source == "none" else _mib(budget.bytes),
            budget.source,
        )
        return
    raise ResourceError(
        f"not enough memory for {what} at batch {estimate.batch_size}: "
        f"needs about {_mib(needed)} (RSS {_mib(now)} now + {estimate.parts()}) "
        f"but the limit is {_mib(budget.bytes)} ({_describe_source(budget.source)}); "
        f"lower the batch size, use a smaller model or {_remedy(budget.source)}"
    )


def _describe_source(source: str) -> str:
    if source == "MemAvailable":
        return "RSS + MemAvailable in /proc/meminfo"
    if source == "budget":
        return "the configured budget"
    return source


def _remedy(source: str) -> str:
    if source.startswith("cgroup"):
        return "raise MemoryMax in the systemd unit"
    if source == "budget":
        return "raise the memory budget"
    return "free memory on the device"


def _mib(count: int) -> str:
    mib = count / _MIB
    if mib < 1:
        return f"{mib:.2f} MiB"
    if mib < 100:
        return f"{mib:.1f} MiB"
    return f"{mib:.0f} MiB"
