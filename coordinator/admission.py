"""Whether a hello may register its device: the checks of docs/protocol.md, section 9,
step 3, in their order. Pure: the engine answers the refusal and changes nothing."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.config import CoordinatorConfig
from coordinator.groups import ArchitectureGroup
from coordinator.strategies.base import Strategy
from protocol.messages import Hello, ReasonCode

__all__ = ["hello_refusal", "unsupported_precision"]


def hello_refusal(
    hello: Hello,
    groups: Mapping[str, ArchitectureGroup],
    registered: Hello | None,
    config: CoordinatorConfig,
    strategy: Strategy,
) -> tuple[ReasonCode, str] | None:
    """Why ``hello`` cannot register its device (its reason code and the ack's detail),
    None when it can. ``registered``: the device's registration so far, if any."""
    group = groups.get(hello.architecture)
    if group is None or hello.fingerprint != group.fingerprint:
        runs = ", ".join(f"{g.name} ({g.fingerprint})" for g in groups.values())
        return (
            ReasonCode.FINGERPRINT_MISMATCH,
            f"fleet runs {runs}; device announced {hello.architecture} ({hello.fingerprint})",
        )
    if registered is not None and registered.architecture != group.name:
        return (
            ReasonCode.FINGERPRINT_MISMATCH,
            f"registered with {registered.architecture}: a device keeps its architecture "
            "for the run",
        )
    if (unsupported := unsupported_precision(hello, config)) is not None:
        return ReasonCode.UNSUPPORTED_PRECISION, unsupported
    if hello.num_samples < 1:
        return ReasonCode.MALFORMED, "a device without training samples cannot join"
    if (refusal := strategy.refuse(hello)) is not None:
        return ReasonCode.CONSENT_REQUIRED, refusal
    return None


def unsupported_precision(hello: Hello, config: CoordinatorConfig) -> str | None:
    """Why the fleet's default precisions do not suit a device that asks for none."""
    speaks = ", ".join(p.value for p in hello.precisions)
    for direction, asked, default in (
        ("downlink", hello.downlink_precision, config.downlink_precision),
        ("uplink", hello.uplink_precision, config.uplink_precision),
    ):
        if asked is None and default not in hello.precisions:
            fleet = f"this fleet's {direction} precision is {default.value}"
            return f"{fleet}; the device speaks {speaks}"
    return None
