"""N models of one architecture evaluated at once, each with its own weights.

:class:`StackedModule` is a twin of a module whose layers take *stacked* weights: every
parameter and buffer gains a leading axis of N rows, row ``i`` being model ``i``'s
tensor. Called with those stacked tensors and a batch for each model, ``(N, B, ...)``,
it returns each model's output, ``(N, B, ...)``; the sum of N per-model losses then has,
through plain autograd, row ``i`` of its gradient equal to model ``i``'s own gradient
(the losses share no weight). This is how the sim trains a cohort of emulated devices as
one computation without ``torch.func.vmap`` (whose first use imports torch's compiler,
seconds of stall, and which runs some layers' backward twice).

The samples of all N models travel as one ``(B * N, ...)`` batch through the module's
own ``forward`` code, sample-major (sample ``j`` of model ``i`` is sample ``j * N + i``,
so that ``(B * N, C, H, W)`` is ``(B, N * C, H, W)`` as it lies in memory); only the
layers with weights are replaced:

* ``Linear``: one batched matrix product, ``(N, B, in) @ (N, in, out)``;
* ``Conv1d``: a grouped convolution with the N models as groups, on the batch seen as
  ``(B, N * C, L)`` (a view of the sample-major flat batch);
* ``Conv2d``: a grouped convolution with the N models as groups (the batch moved into
  the channels: ``(B, N * C, H, W)``, channels-last, which the CPU's kernels run about as
  fast as one model's convolution over ``N * B`` samples), or a batched matrix product
  when the kernel covers the whole input (LeNet-5's last convolution);
* ``GroupNorm``: the per-sample normalisation, then each model's scale and shift;
* ``BatchNorm1d`` / ``BatchNorm2d``: each model's batch statistics (its B samples) and
  running statistics, through the grouped-channels layout.

Layers without weights that act on each sample alone (activations, pooling, flatten,
upsampling, identity) are kept. In an ``nn.Sequential`` of single layers the
convolutions hand each other their grouped channels-last output: the activations and
pooling between them run on it as it lies (they act on each channel's plane, the same
in either layout), and only a layer that needs the flat layout gets it; on a CPU this
made a LeNet-5 cohort 1.5x faster (its max pooling runs several times faster
channels-last). Two rewrites of such a chain change no value: a ReLU that a max pooling
follows runs after it, and a nearest x2 upsampling with the 3x3 convolution after it runs
as one transposed convolution (the same values up to rounding); and a chain that follows
another in the model's ``forward`` takes the grouped tensor back rather than converting
the flat copy it was handed. A module with any other layer, or with weights outside
these layers, cannot be stacked: :attr:`StackedModule.unstackable` says why, and the
caller trains such models one at a time.

Pure: tensors in, tensors out; running statistics of stacked BatchNorm buffers are
updated in place, as ``nn.BatchNorm`` updates its own.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from contextvars import ContextVar
from typing import cast

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.func import functional_call

__all__ = ["PER_SAMPLE_LAYERS", "StackedModule"]

_ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.ReLU,
    nn.LeakyReLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.GELU,
    nn.SiLU,
    nn.ELU,
    nn.Identity,
)
"""Weight-free layers that act on each element alone."""

PER_SAMPLE_LAYERS: tuple[type[nn.Module], ...] = (
    *_ELEMENTWISE,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.Flatten,
    nn.Upsample,
)
"""Weight-free layers that act on each sample on its own: kept as they are."""


def _rows(weight: torch.Tensor) -> int:
    return int(weight.shape[0])


class _Linear(nn.Module):
    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.weight = layer.weight  # replaced by functional_call
        self.bias = layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = _rows(self.weight)
        samples = x.shape[0] // n
        rows = x.reshape(samples, n, -1, x.shape[-1]).transpose(0, 1)  # (N, B, ..., in)
        rows = rows.reshape(n, -1, x.shape[-1])
        if self.bias is None:
            out = torch.bmm(rows, self.weight.transpose(1, 2))
        else:
            out = torch.baddbmm(self.bias.unsqueeze(1), rows, self.weight.transpose(1, 2))
        out = out.reshape(n, samples, -1, out.shape[-1]).transpose(0, 1)
        return out.reshape(*x.shape[:-1], out.shape[-1])


class _Conv(nn.Module):
    """What a stacked convolution keeps of its layer: the weights (replaced by
    ``functional_call``) and the geometry."""

    def __init__(self, layer: nn.Conv1d | nn.Conv2d) -> None:
        super().__init__()
        self.weight = layer.weight
        self.bias = layer.bias
        self.stride = layer.stride
        self.padding = layer.padding
        self.dilation = layer.dilation
        self.groups = layer.groups


class _Conv1d(_Conv):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A grouped convolution of the flat ``(B * N, C, L)`` batch seen as ``(B, N * C,
        L)`` (sample-major: a view), the N models as groups; back to ``(B * N, C', L')``."""
        n = _rows(self.weight)
        out_channels = int(self.weight.shape[1])
        grouped = x.reshape(x.shape[0] // n, n * x.shape[1], x.shape[2])
        weight = self.weight.reshape(n * out_channels, *self.weight.shape[2:])
        bias = None if self.bias is None else self.bias.reshape(n * out_channels)
        out = F.conv1d(
            grouped, weight, bias, self.stride, self.padding, self.dilation, self.groups * n
        )
        return out.reshape(x.shape[0], out_channels, out.shape[-1])


class _Conv2d(_Conv):
    def _covers_input(self, x: torch.Tensor) -> bool:
        """The kernel spans the whole unpadded input once: a matrix product."""
        k = self.weight.shape[-2:]
        return (
            self.padding in ((0, 0), "valid")
            and self.groups == 1
            and self.dilation == (1, 1)
            and tuple(x.shape[-2:]) == tuple(k)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._covers_input(x):
            return _flat(self.grouped(x, grouped=False), _rows(self.weight))
        n = _rows(self.weight)
        out_channels = int(self.weight.shape[1])
        samples = x.shape[0] // n
        rows = x.reshape(samples, n, -1).transpose(0, 1)  # (N, B, C*H*W)
        weight = self.weight.reshape(n, out_channels, -1).transpose(1, 2)
        if self.bias is None:
            out = torch.bmm(rows, weight)
        else:
            out = torch.baddbmm(self.bias.unsqueeze(1), rows, weight)
        return out.transpose(0, 1).reshape(samples * n, out_channels, 1, 1)

    def grouped(self, x: torch.Tensor, *, grouped: bool) -> torch.Tensor:
        """The convolution of ``x``, flat ``(B * N, C, H, W)`` or grouped ``(B, N * C, H,
        W)``, as a grouped ``(B, N * C_out, H', W')`` channels-last tensor."""
        n = _rows(self.weight)
        out_channels = int(self.weight.shape[1])
        x = _grouped_input(x, n, grouped=grouped)
        weight = self.weight.reshape(n * out_channels, *self.weight.shape[2:])
        bias = None if self.bias is None else self.bias.reshape(n * out_channels)
        return F.conv2d(x, weight, bias, self.stride, self.padding, self.dilation, self.groups * n)


PLANE_WISE_LAYERS: tuple[type[nn.Module], ...] = (
    *_ELEMENTWISE,
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool2d,
    nn.Upsample,
)
"""Layers that act on each element, or on each channel's plane alone: the same on a
grouped ``(B, N * C, H, W)`` tensor as on the flat ``(B * N, C, H, W)`` one."""


_Flattened = dict[int, tuple[torch.Tensor, int, torch.Tensor, int, int]]
"""By ``id`` of a flat tensor: it, its version, the grouped tensor it was copied from,
that one's version, and the models N."""

_FLATTENED: ContextVar[_Flattened | None] = ContextVar("stacked_flattened", default=None)
"""The flat copies made during the current :class:`StackedModule` call (None outside
one), so that a later layer that wants the grouped layout back takes the grouped tensor
itself (see :func:`_grouped_channels_last`)."""


def _flat(x: torch.Tensor, n: int) -> torch.Tensor:
    """A grouped ``(B, N * C, H, W)`` tensor as the flat ``(B * N, C, H, W)`` one."""
    flat = x.reshape(x.shape[0] * n, x.shape[1] // n, *x.shape[2:])
    made = _FLATTENED.get()
    if made is not None and x.dim() == 4 and flat.data_ptr() != x.data_ptr():
        made[id(flat)] = (flat, flat._version, x, x._version, n)
    return flat


class _GroupedSequential(nn.Sequential):
    """A chain of layers whose convolutions hand each other grouped channels-last
    tensors: between two convolutions, activations and pooling run on the grouped
    ``(B, N * C, H, W)`` tensor as it lies, with no round trip through the flat layout
    (on a CPU max pooling runs several times faster channels-last). Any other layer, and
    the chain's caller, get the flat tensor."""

    def __init__(self, layers: OrderedDict[str, nn.Module]) -> None:
        super().__init__(layers)
        self._order = _upsampling_fused(_pooled_first(list(self)))
        """The layers in the order they run (see :func:`_pooled_first`), an upsampling
        and the convolution after it as one step (:class:`_UpsampledConv`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = 0  # the models of the grouped tensor; 0: x is flat
        layers = self._order
        for i, layer in enumerate(layers):
            if isinstance(layer, _UpsampledConv):
                x, n = layer.grouped(x, grouped=n > 0), _rows(layer.conv.weight)
            elif isinstance(layer, _Conv2d) and not layer._covers_input(x):
                x, n = layer.grouped(x, grouped=n > 0), _rows(layer.weight)
            elif n and isinstance(layer, PLANE_WISE_LAYERS):
                x = layer(x)
            elif n and isinstance(layer, _BatchNorm) and layer.rows == n:
                x = layer.grouped(x)
            elif not n and x.dim() == 4 and (rows := _grouped_ahead(layers[i:])):
                # plane-wise layers before a convolution (an upsampling, say) run on the
                # grouped channels-last tensor the convolution wants: converted here,
                # where it is smallest, not after them
                x, n = _grouped_channels_last(x, rows), rows
                x = layer(x)
            else:
                if n:
                    x, n = _flat(x, n), 0
                x = layer(x)
        return _flat(x, n) if n else x


def _pooled_first(layers: list[nn.Module]) -> list[nn.Module]:
    """``layers`` with each ReLU that a max pooling follows run after that pooling.

    The two commute exactly: the largest of a window's rectified values is the rectified
    largest value, and its gradient reaches the same element (the window's maximum, where
    it is positive; nothing where it is not). Pooling first rectifies a quarter of the
    elements (LeNet-5's first stage: the step's ReLU and its backward over the
    convolution's whole output were a quarter of a cohort's step on a CPU).
    """
    order = list(layers)
    for i in range(len(order) - 1):
        relu, pool = order[i], order[i + 1]
        if type(relu) is nn.ReLU and type(pool) is nn.MaxPool2d and not pool.return_indices:
            order[i], order[i + 1] = pool, relu
    return order


_UP_MIX = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
"""Row t: the taps of a 3-tap kernel that reach output ``2 i + t - 1`` from input ``i``
once the input is repeated twice (nearest upsampling) before the kernel runs."""


class _UpsampledConv:
    """A nearest x2 upsampling and the 3x3 convolution after it (stride 1, padding 1),
    as the one transposed convolution they are (stride 2, padding 1, 4x4 kernels whose
    taps are sums of the 3x3 kernel's): the same values up to rounding, from a quarter
    of the samples' positions and without the upsampled tensor (an image generator's
    last block: the convolution's forward and backward about twice as fast on this
    project's CPU, the whole block with its BatchNorm 1.3x to 1.5x)."""

    def __init__(self, conv: _Conv2d) -> None:
        self.conv = conv

    @staticmethod
    def fits(upsample: nn.Module, conv: nn.Module) -> bool:
        """Whether ``upsample`` then ``conv`` is such a pair."""
        if type(upsample) is not nn.Upsample or not isinstance(conv, _Conv2d):
            return False
        factor = upsample.scale_factor
        if factor is None or upsample.size is not None:
            return False
        factors = factor if isinstance(factor, tuple) else (factor, factor)
        return (
            upsample.mode == "nearest"
            and tuple(float(f) for f in factors) == (2.0, 2.0)
            and tuple(conv.weight.shape[-2:]) == (3, 3)
            and conv.stride == (1, 1)
            and conv.padding == (1, 1)
            and conv.dilation == (1, 1)
        )

    def grouped(self, x: torch.Tensor, *, grouped: bool) -> torch.Tensor:
        """The output of ``x``, flat ``(B * N, C, H, W)`` or grouped ``(B, N * C, H, W)``,
        as a grouped ``(B, N * C', 2H, 2W)`` channels-last tensor (as
        :meth:`_Conv2d.grouped`)."""
        conv = self.conv
        n = _rows(conv.weight)
        x = _grouped_input(x, n, grouped=grouped)
        groups = conv.groups * n
        weight = conv.weight.reshape(-1, *conv.weight.shape[2:])  # (N * C', C / g, 3, 3)
        mix = _UP_MIX.to(weight)
        kernel = torch.einsum("ta,oiab,sb->oits", mix, weight, mix)
        per_group = kernel.shape[0] // groups
        # a transposed convolution's kernel is (in, out / groups, kh, kw)
        kernel = kernel.reshape(groups, per_group, -1, 4, 4).transpose(1, 2)
        kernel = kernel.reshape(-1, per_group, 4, 4)
        bias = None if conv.bias is None else conv.bias.reshape(-1)
        return F.conv_transpose2d(x, kernel, bias, stride=2, padding=1, groups=groups)


def _upsampling_fused(layers: list[nn.Module]) -> list[nn.Module | _UpsampledConv]:
    """``layers`` with each upsampling that :meth:`_UpsampledConv.fits` its next
    convolution run as one :class:`_UpsampledConv` with it."""
    order: list[nn.Module | _UpsampledConv] = []
    i = 0
    while i < len(layers):
        if i + 1 < len(layers) and _UpsampledConv.fits(layers[i], layers[i + 1]):
            conv = layers[i + 1]
            assert isinstance(conv, _Conv2d)  # fits says so
            order.append(_UpsampledConv(conv))
            i += 2
        else:
            order.append(layers[i])
            i += 1
    return order


def _grouped_ahead(layers: list[nn.Module | _UpsampledConv]) -> int:
    """The models of the convolution that plane-wise ``layers[0], ...`` lead to (0: they
    lead to none, or ``layers[0]`` is not plane-wise)."""
    for layer in layers:
        if isinstance(layer, _UpsampledConv):
            return _rows(layer.conv.weight)
        if isinstance(layer, _Conv2d):
            return _rows(layer.weight)
        if not isinstance(layer, PLANE_WISE_LAYERS):
            return 0
    return 0


def _grouped_input(x: torch.Tensor, n: int, *, grouped: bool) -> torch.Tensor:
    """A convolution's input ``x``, already grouped or flat, as the grouped channels-last
    tensor of ``n`` models."""
    if grouped:
        return x.contiguous(memory_format=torch.channels_last)
    return _grouped_channels_last(x, n)


def _grouped_channels_last(x: torch.Tensor, n: int) -> torch.Tensor:
    """A flat ``(B * N, C, H, W)`` tensor as the grouped ``(B, N * C, H, W)`` one,
    channels-last.

    A flat copy :func:`_flat` made in the same call (two chains of a model's
    ``forward``, one after the other: a generator's blocks) gives back the grouped
    tensor it was copied from, when neither was changed in place since: no second copy,
    and the gradient reaches that tensor in the layout it lies in."""
    made = _FLATTENED.get()
    if made is not None and (found := made.get(id(x))) is not None:
        flat, version, grouped, grouped_version, rows = found
        unchanged = x._version == version and grouped._version == grouped_version
        if flat is x and rows == n and unchanged:
            return grouped
    grouped = x.reshape(x.shape[0] // n, -1, *x.shape[2:])  # sample-major: a view
    return grouped.contiguous(memory_format=torch.channels_last)


class _GroupNorm(nn.Module):
    def __init__(self, layer: nn.GroupNorm) -> None:
        super().__init__()
        self.weight = layer.weight
        self.bias = layer.bias
        self.num_groups = layer.num_groups
        self.eps = layer.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.group_norm(x, self.num_groups, eps=self.eps)
        if self.weight is None:
            return out
        n = _rows(self.weight)
        shape = (1, n, x.shape[1]) + (1,) * (x.dim() - 2)
        scaled = out.reshape(-1, n, *x.shape[1:]) * self.weight.reshape(shape)
        if self.bias is not None:
            scaled = scaled + self.bias.reshape(shape)
        return scaled.reshape(x.shape)


class _BatchNorm(nn.Module):
    def __init__(self, layer: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__()
        self.weight = layer.weight
        self.bias = layer.bias
        self.register_buffer("running_mean", layer.running_mean)
        self.register_buffer("running_var", layer.running_var)
        self.register_buffer("num_batches_tracked", layer.num_batches_tracked)
        self.eps = layer.eps
        self.momentum = layer.momentum
        self.track_running_stats = layer.track_running_stats

    @property
    def rows(self) -> int:
        """The models this layer's stacked state holds."""
        some = self.weight if self.weight is not None else self.running_mean
        assert isinstance(some, torch.Tensor)  # weights or statistics: see forward
        return _rows(some)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.rows
        samples = x.shape[0] // n
        grouped = x.reshape(samples, n * x.shape[1], *x.shape[2:])  # sample-major: a view
        return self.grouped(grouped).reshape(x.shape)

    def grouped(self, grouped: torch.Tensor) -> torch.Tensor:
        """The normalisation of a grouped ``(B, N * C, ...)`` tensor, in its layout (the
        flat one's, :meth:`forward`): each model's channels are channels of their own."""
        stats = cast("torch.Tensor | None", self.running_mean)
        variance = cast("torch.Tensor | None", self.running_var)
        tracked = cast("torch.Tensor | None", self.num_batches_tracked)
        weight = cast("torch.Tensor | None", self.weight)
        bias = cast("torch.Tensor | None", self.bias)
        channels = grouped.shape[1]
        use_batch = self.training or stats is None
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and tracked is not None:
            tracked.add_(1)
            if self.momentum is None:  # a cumulative average, as nn.BatchNorm keeps it
                momentum = 1.0 / float(tracked.reshape(-1)[0])
        return F.batch_norm(
            grouped,
            None if stats is None else stats.view(channels),
            None if variance is None else variance.view(channels),
            None if weight is None else weight.reshape(channels),
            None if bias is None else bias.reshape(channels),
            use_batch,
            momentum,
            self.eps,
        )


def _stacked_layer(layer: nn.Module) -> nn.Module | None:
    """The stacked twin of a layer with weights, or None when there is none."""
    if type(layer) is nn.Linear:
        return _Linear(layer)
    if type(layer) is nn.Conv2d and layer.padding_mode == "zeros":
        return _Conv2d(layer)
    if type(layer) is nn.Conv1d and layer.padding_mode == "zeros":
        return _Conv1d(layer)
    if type(layer) is nn.GroupNorm:
        return _GroupNorm(layer)
    if type(layer) in (nn.BatchNorm1d, nn.BatchNorm2d):
        return _BatchNorm(layer)  # type: ignore[arg-type]
    return None


class StackedModule:
    """N copies of ``module``'s architecture, each with its own stacked weights.

    Args:
        module: the architecture (its weights are not used and not copied: the twin is
            built on the meta device).
    """

    def __init__(self, module: nn.Module) -> None:
        memo: dict[int, object] = {}
        for tensor in list(module.parameters()) + list(module.buffers()):
            memo[id(tensor)] = (
                nn.Parameter(torch.empty_like(tensor, device="meta"), tensor.requires_grad)
                if isinstance(tensor, nn.Parameter)
                else torch.empty_like(tensor, device="meta")
            )
        self.twin: nn.Module = copy.deepcopy(module, memo)
        self.unstackable = self._replace_layers()
        """Why the module cannot be stacked, or "" when it can."""
        if not self.unstackable:
            self._group_chains()

    def _replace_layers(self) -> str:
        def refused(name: str, layer: nn.Module) -> str:
            kind = type(layer).__name__
            return f"layer {name or kind} ({kind}) has no stacked form"

        for name, layer in list(self.twin.named_modules()):
            own = list(layer.named_parameters(recurse=False))
            own += list(layer.named_buffers(recurse=False))
            leaf = next(layer.children(), None) is None
            if not own:
                if leaf and not isinstance(layer, PER_SAMPLE_LAYERS):
                    return refused(name, layer)
                continue
            stacked = _stacked_layer(layer)
            if stacked is None or not leaf:
                return refused(name, layer)
            self._put(name, stacked)
        return ""

    def _put(self, name: str, module: nn.Module) -> None:
        """``module`` in place of the twin's submodule ``name`` ("": the twin itself)."""
        if not name:
            self.twin = module
            return
        parent_name, _, attr = name.rpartition(".")
        parent = self.twin.get_submodule(parent_name) if parent_name else self.twin
        setattr(parent, attr, module)

    def _group_chains(self) -> None:
        """Each ``nn.Sequential`` of single layers becomes a :class:`_GroupedSequential`
        (same layers, same order: the state's names do not change)."""
        for name, chain in list(self.twin.named_modules()):
            if type(chain) is not nn.Sequential:
                continue
            if any(next(layer.children(), None) is not None for layer in chain):
                continue
            self._put(name, _GroupedSequential(OrderedDict(chain.named_children())))

    def train(self, mode: bool = True) -> StackedModule:
        """Training or evaluation mode (BatchNorm's batch or running statistics)."""
        self.twin.train(mode)
        return self

    def __call__(self, state: Mapping[str, torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        """Each model's output for its own inputs.

        Args:
            state: every parameter and buffer of the module by name, stacked ``(N, ...)``.
            inputs: the module's inputs, each ``(N, B, ...)``: model ``i`` gets row ``i``.

        Returns:
            ``(N, B, ...)``: row ``i`` is model ``i``'s output.

        Raises:
            ValueError: the module cannot be stacked (see :attr:`unstackable`).
        """
        if self.unstackable:
            raise ValueError(self.unstackable)
        n, b = inputs[0].shape[:2]
        # sample-major: row i's sample j is sample j * N + i of the module's batch, so
        # that (B * N, C, ...) is (B, N * C, ...) without a copy
        flat = [x.transpose(0, 1).reshape(b * n, *x.shape[2:]) for x in inputs]
        token = _FLATTENED.set({})
        try:
            out: torch.Tensor = functional_call(self.twin, dict(state), tuple(flat), strict=True)
        finally:
            _FLATTENED.reset(token)
        return out.reshape(b, n, *out.shape[1:]).transpose(0, 1)
