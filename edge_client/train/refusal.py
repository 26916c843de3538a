"""Why a device is not let into its fleet: a refusal of its hello, or no answer at all
(the rules are :class:`~edge_client.train.session.DeviceSession`'s, "Hello rules")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from protocol.messages import Ack, ReasonCode

__all__ = [
    "ADVICE",
    "HELLOS_REMEMBERED",
    "LIVE_STATES",
    "MAX_HELLO_WAIT_S",
    "REFUSAL_LOG_INTERVAL_S",
    "Refusal",
    "no_answer_hint",
    "refused_text",
]

REFUSAL_LOG_INTERVAL_S = 60.0
"""A refusal of the device's hello is logged at ERROR at most this often per reason."""
MAX_HELLO_WAIT_S = 600.0
"""The longest wait between two hints of an unanswered hello (the wait doubles)."""
HELLOS_REMEMBERED = 16
"""Ids of the device's last hellos kept, to tell the acks of hellos from those of updates."""
LIVE_STATES = ("starting", "waiting", "running")
"""Coordinator states in which it answers every hello it can authenticate."""
ADVICE = {
    ReasonCode.FINGERPRINT_MISMATCH: "the device's model must be the fleet's: run the "
    "fleet's architecture (--model) on data with the fleet's number of classes, channels "
    "and image size",
    ReasonCode.UNSUPPORTED_PRECISION: "ask for a precision the fleet runs (--precision, "
    "--downlink-precision, --uplink-precision)",
    ReasonCode.CONSENT_REQUIRED: "start the device with --share-label-counts if it may "
    "share its label counts",
    ReasonCode.MALFORMED: "give the device a data file with training samples (--data)",
}
"""What to do about each reason a hello is refused for."""


@dataclass(frozen=True)
class Refusal:
    """Why the device gave up joining its fleet (``exit_when_refused``)."""

    kind: Literal["refused", "unanswered"]
    """``refused``: the coordinator nacked the hello; ``unanswered``: nobody answered it
    within ``hello_timeout_s``."""
    message: str
    """What was logged: the reason and what to do."""


def no_answer_hint(
    *, fleet: str, device_id: str, broker: str, state: str | None, reads_status: bool, waited: float
) -> tuple[str, bool]:
    """Why no coordinator of ``fleet`` answered the hello of ``device_id`` in ``waited``
    seconds, from the coordinator status the device saw (``state``; None: none, and
    ``reads_status``: whether it can read one at all); and whether waiting on is hopeless
    (False: the coordinator is stopped or finished, and answers no hello until it
    starts)."""
    device = device_id
    head = (
        f"no answer from a coordinator of fleet {fleet} in {waited:.0f} s: check "
        f"--fleet, the broker and the device key"
    )
    if state == "stopped":
        return f"{head}; the coordinator of fleet {fleet} is stopped: waiting for it", False
    if state == "finished":
        return f"{head}; the coordinator of fleet {fleet} finished its run", False
    if state in LIVE_STATES:
        why = (
            f"the coordinator of fleet {fleet} is up (status {state}) but silent: it "
            f"cannot authenticate device {device}, so the device key is likely wrong "
            "or not registered (--auth-key-file / --fleet-token-file here, "
            "--device-keys or --fleet-token-file at the coordinator), or the id is "
            "revoked"
        )
    elif reads_status:
        why = (
            f"no coordinator status on fleet {fleet} either, so the fleet name "
            f"(--fleet {fleet}) or the broker ({broker}) is likely wrong, or the "
            "coordinator has not started"
        )
    else:
        why = (
            "this device reads no coordinator status (no --coordinator-key-file), so "
            "it cannot tell whether the fleet name, the broker or the key is wrong"
        )
    return f"{head}; {why}", True


def refused_text(fleet: str, ack: Ack, device: str) -> str:
    """What a device logs when the coordinator of ``fleet`` refused its hello with
    ``ack``: the reason, the coordinator's detail, the ``device``'s own model and what to
    do about it."""
    return (
        f"the coordinator of fleet {fleet} refused this device ({ack.reason.value}): "
        f"{ack.detail or 'no detail'}; this device: {device}; "
        f"{ADVICE.get(ack.reason, 'see the coordinator log')}"
    )
