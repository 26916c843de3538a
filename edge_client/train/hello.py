"""What a training device says in its hello: :func:`device_hello` builds it from the
device's configuration and :class:`ModelDescription`, what the hello says of the model
beside its fingerprint (docs/protocol.md, section 4). Pure: no I/O but reading the
installed package's version once."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from edge_client.config import ClientConfig
from protocol import __version__ as protocol_version
from protocol.messages import MAX_LAYOUT_NAME_CHARS, MAX_LAYOUT_TENSORS, Hello
from protocol.tensors import Precision

__all__ = ["ModelDescription", "device_hello"]


@functools.cache  # the installed version does not change while the process runs
def _software_version() -> str:
    try:
        return importlib.metadata.version("edgefl")[:64]
    except importlib.metadata.PackageNotFoundError:
        return protocol_version


@dataclass(frozen=True)
class ModelDescription:
    """What a device's hello says of its model beside its fingerprint: the shape of one
    sample, the classes and the tensors' names and shapes, so that a coordinator that
    refuses the model can name how it differs from the fleet's (docs/protocol.md,
    section 4)."""

    input_shape: tuple[int, ...]
    num_classes: int
    layout: Mapping[str, tuple[int, ...]] | None
    """Tensor name -> shape (what the fingerprint is computed from); None when it does
    not fit a hello (more than :data:`~protocol.messages.MAX_LAYOUT_TENSORS` tensors,
    or a name longer than :data:`~protocol.messages.MAX_LAYOUT_NAME_CHARS`)."""

    @classmethod
    def of(
        cls,
        input_shape: Sequence[int],
        num_classes: int,
        shapes: Mapping[str, Sequence[int]],
    ) -> ModelDescription:
        """The description of a model with these tensors (the layout left out where it
        does not fit a hello)."""
        fits = 0 < len(shapes) <= MAX_LAYOUT_TENSORS and all(
            0 < len(name) <= MAX_LAYOUT_NAME_CHARS and len(shape) <= 8
            for name, shape in shapes.items()
        )
        layout = {n: tuple(int(d) for d in shape) for n, shape in shapes.items()} if fits else None
        return cls(tuple(int(d) for d in input_shape), int(num_classes), layout)

    def summary(self, architecture: str) -> str:
        """``lenet5, 26 classes, input 1x28x28``: the model for people."""
        shape = "x".join(str(d) for d in self.input_shape)
        return f"{architecture}, {self.num_classes} classes, input {shape}"


def device_hello(
    config: ClientConfig,
    *,
    fingerprint: str,
    num_samples: int,
    held_base: str | None,
    memory_bytes: int,
    model: ModelDescription | None = None,
) -> Hello:
    """The hello a device with ``config`` announces itself with (``memory_bytes``: the
    machine's physical memory, 0 if unknown; ``model``: what it says of its model
    beside the fingerprint, None: nothing)."""
    return Hello(
        device_id=config.device_id,
        architecture=config.model,
        fingerprint=fingerprint,
        precisions=tuple(Precision),
        memory_bytes=memory_bytes,
        threads=config.threads,
        software_version=_software_version(),
        num_samples=num_samples,
        share_label_counts=config.share_label_counts,
        platform=platform.machine()[:64],
        downlink_precision=config.downlink_precision,
        uplink_precision=config.uplink_precision,
        held_base=held_base,
        weight_format=config.weight_format,
        input_shape=None if model is None else model.input_shape,
        num_classes=None if model is None else model.num_classes,
        layout=None if model is None else model.layout,
    )
