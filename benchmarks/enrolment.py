"""Enrolment benchmark: what a fleet token costs the coordinator (docs/protocol.md 2.4).

Measured on the coordinator's key source (:class:`coordinator.enrolment.FleetKeys`) with
real HMAC-SHA256 and real files (a temporary state dir, fsynced atomic writes):

- ``derive_us``: one key derivation (``derive_device_key``), in microseconds;
- ``forged_registered_us`` / ``forged_token_us``: refusing one forged frame (a device
  status, signed with a wrong key) of an id the coordinator does not know, without a
  token (refused at the key lookup) and with one (a derivation, then the tag check
  fails), in microseconds: what a flood of forgeries costs;
- ``enrol_ms_first`` / ``enrol_ms_last``: one enrolment (key lookup, tag check, one line
  appended to the enrolment journal and fsynced) at the start and at the end of enrolling
  ``--devices`` ids, in milliseconds (median of ten): an append, so the last should cost
  what the first did (the whole keyring was rewritten each time before, 12 ms at the
  start and 27 ms at the 1,024th); ``enrol_s_total`` for all of them, ``journal_bytes``
  the journal's final size.

Run: ``python -m benchmarks.enrolment [--devices N] [--repeats N] [--json]``. Timings
depend on the machine's load and its disk's fsync latency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from coordinator.enrolment import ENROLLED_JOURNAL, FleetKeys
from protocol.auth import AuthError, Keyring, derive_device_key, new_key, seal, verify
from protocol.codec import Codec
from protocol.messages import DeviceStatus, Message


def per_call_us(fn: Callable[[], Any], repeats: int) -> float:
    """Median over five batches of ``repeats`` calls, in microseconds per call."""
    batches = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        batches.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(batches)


def forged_frame(device_id: str) -> tuple[str, bytes]:
    topic = f"fl/bench/devices/{device_id}/status"
    message = Message(fleet="bench", sender=device_id, body=DeviceStatus(state="idle"))
    return topic, seal(new_key(), topic, Codec().encode(message))


def refuse(keys: FleetKeys, device_id: str, topic: str, frame: bytes) -> None:
    """What the coordinator's channel does with a frame of an unknown id."""
    try:
        verify(keys.receive_key(device_id), topic, frame)
    except AuthError:
        return
    raise AssertionError("a forged frame verified")


def enrol_all(state: Path, token: bytes, devices: int) -> dict[str, float]:
    keys = FleetKeys(Keyring(), token=token, state_dir=state, max_enrolled=devices)
    codec = Codec()
    times = []
    for i in range(devices):
        device_id = f"dev-{i:05d}"
        topic = f"fl/bench/devices/{device_id}/status"
        message = Message(fleet="bench", sender=device_id, body=DeviceStatus(state="idle"))
        frame = seal(derive_device_key(token, device_id), topic, codec.encode(message))
        start = time.perf_counter()
        verify(keys.receive_key(device_id), topic, frame)
        keys.authenticated(device_id)
        times.append(time.perf_counter() - start)
    assert keys.enrolments == devices
    return {
        "enrol_ms_first": statistics.median(times[:10]) * 1e3,
        "enrol_ms_last": statistics.median(times[-10:]) * 1e3,
        "enrol_s_total": sum(times),
        "journal_bytes": (state / ENROLLED_JOURNAL).stat().st_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=1024, help="ids to enrol (default 1024)")
    parser.add_argument("--repeats", type=int, default=2000, help="calls per timing batch")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    token = new_key()
    topic, frame = forged_frame("stranger")
    with tempfile.TemporaryDirectory() as tmp:
        without = FleetKeys(Keyring({"dev-0": new_key()}), state_dir=Path(tmp) / "a")
        with_token = FleetKeys(Keyring(), token=token, state_dir=Path(tmp) / "b")
        row: dict[str, float] = {
            "derive_us": per_call_us(lambda: derive_device_key(token, "dev-00001"), args.repeats),
            "forged_registered_us": per_call_us(
                lambda: refuse(without, "stranger", topic, frame), args.repeats
            ),
            "forged_token_us": per_call_us(
                lambda: refuse(with_token, "stranger", topic, frame), args.repeats
            ),
        }
        assert not (Path(tmp) / "b" / ENROLLED_JOURNAL).exists()  # forgeries enrolled nobody
        row |= enrol_all(Path(tmp) / "c", token, args.devices)
    if args.json:
        print(json.dumps({"devices": args.devices, **row}))
        return
    print(f"enrolment with a fleet token, {args.devices} devices")
    for name, value in row.items():
        print(
            f"  {name:<22}{value:>12.3f}"
            if isinstance(value, float)
            else f"  {name:<22}{value:>12}"
        )


if __name__ == "__main__":
    main()
