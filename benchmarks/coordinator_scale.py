"""Coordinator work per update at 1,000 / 10,000 / 100,000 devices (issue "Fleet scale").

The real :class:`~coordinator.runtime.Coordinator` (its :class:`~coordinator.engine.
RoundEngine`, a :class:`~coordinator.store.FileStore` in a temporary directory, a
:class:`~protocol.auth.Keyring` of one key per device) runs on its own thread against an
in-process :class:`~protocol.transport.MemoryBroker`. A second client publishes for the
devices, pre-encoded and pre-signed frames: N hellos (all N devices are selected when
the last one arrives, one round), then N updates, so each update takes the path a real
one takes: its tag verified under its device's key, decoded, replay-checked, validated,
norm-screened, stored, acknowledged (the ack encoded, sealed and published). Nothing
trains: an update is the round's model (FedGen's CNN at 8 x 8 pixels, 3,350 parameters,
so 100,000 of them fit in memory and on disk) plus a little noise of the device's own.

Frames are built in batches of ``--batch`` before each batch's timer starts; a batch is
timed from its first publish to the acknowledgement of its last update. Reported per
fleet size:

* ``us_per_update``: microseconds per update over the round's first N - 1 updates (the
  last one closes the round: ``close_s``, persisting which updates it aggregates);
  ``cpu_us_per_update``: the process's CPU time over the same updates (all its threads),
  steadier than the wall clock on a machine other work shares;
* ``us_per_hello``, ``cpu_us_per_hello``: the same over the first N - 1 hellos
  (registration: the entry written to the store); ``round_start_s``: the last hello,
  whose round start sends every device its model and task;
* ``finish_s``: from the last update to the run's end (aggregation of the N updates,
  read back from the store, and the cleanup of their records); ``aggregate_s`` is the
  server step alone, as the coordinator reports it.

The coordinator's work per event does not depend on N, so ``us_per_update`` should stay
flat within 2x from 1,000 to 100,000 devices (printed as the ratio of the largest to
the smallest size). The state directory goes to ``/dev/shm`` where there is one
(``--tmp`` chooses another folder) and the store writes without fsync (``--fsync``
turns it on): on a virtual disk creating a file alone can take a millisecond and an
fsynced write several, the same at every fleet size, which would hide the coordinator's
own work and make 100,000 devices take hours. A real coordinator keeps fsync on: add
what its disk takes for a write per new hello and per update.

Run from the repository root::

    python -m benchmarks.coordinator_scale                      # 1k, 10k, 100k devices
    python -m benchmarks.coordinator_scale --devices 1000 --fsync
    python -m benchmarks.coordinator_scale --json rows.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from coordinator.actions import Action, Finished, Publish, RoundClosed, RoundStarted
from coordinator.config import CoordinatorConfig
from coordinator.runtime import Coordinator, build_models
from coordinator.store import FileStore
from protocol.auth import Keyring, new_key
from protocol.channel import Channel
from protocol.messages import Ack, Hello, Message, Update
from protocol.tensors import Precision
from protocol.tensorset import encode_tensors
from protocol.topics import Topics
from protocol.transport import MemoryBroker, MemoryTransport

__all__ = ["DEFAULT_SIZES", "coordinator_rows", "main", "measure"]

FLEET = "scale"
MODEL = "fedgen_cnn"
IMAGE_SIZE = 8
DEFAULT_SIZES = (1_000, 10_000, 100_000)
Array = npt.NDArray[Any]


class _Watch:
    """An observer of the coordinator's actions: counts the acks it publishes (and the
    refused ones), remembers when the round started and when the run finished."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.acks = 0
        self.refused: list[str] = []
        self.ready = False
        self.round_started: float | None = None
        self.closed: RoundClosed | None = None
        self.finished: float | None = None

    def __call__(self, action: Action) -> None:
        with self._cond:
            if isinstance(action, Publish):
                self.ready = True
                body = action.message.body
                if isinstance(body, Ack):
                    self.acks += 1
                    if not body.accepted:
                        self.refused.append(f"{action.topic}: {body.reason.value} {body.detail}")
            elif isinstance(action, RoundStarted):
                self.round_started = time.perf_counter()
            elif isinstance(action, RoundClosed):
                self.closed = action
            elif isinstance(action, Finished):
                self.finished = time.perf_counter()
            self._cond.notify_all()

    def wait(self, done: Callable[[], bool], timeout_s: float, what: str) -> float:
        """Wait until ``done()``; returns the time it was seen (perf_counter)."""
        with self._cond:
            if not self._cond.wait_for(done, timeout_s):
                raise TimeoutError(f"timed out waiting for {what}")
        return time.perf_counter()


def _hello(device_id: str, architecture: str, fingerprint: str) -> Message:
    body = Hello(
        device_id=device_id,
        architecture=architecture,
        fingerprint=fingerprint,
        precisions=(Precision.FP32,),
        memory_bytes=0,
        threads=1,
        software_version="bench",
        num_samples=100,
    )
    return Message(fleet=FLEET, sender=device_id, body=body)


def _update(device_id: str, model: dict[str, Array], rng: np.random.Generator) -> Message:
    """The round's model plus noise of the device's own: well within norm screening."""
    weights = {
        name: (array + rng.normal(0.0, 0.01, array.shape)).astype(array.dtype)
        for name, array in model.items()
    }
    body = Update(
        num_samples=100,
        sets={"weights": encode_tensors(weights, Precision.FP32)},
        metrics={"loss": 1.0},
    )
    return Message(fleet=FLEET, sender=device_id, round=1, body=body)


def _feed(
    transport: MemoryTransport,
    frames: Sequence[tuple[str, bytes]],
    watch: _Watch,
    acks_before: int,
    timeout_s: float,
) -> tuple[float, float]:
    """Publish ``frames``; returns the seconds until every one was acknowledged, and
    the CPU seconds the process spent meanwhile (all its threads: the coordinator's,
    its transport's and this publishing one)."""
    start, cpu = time.perf_counter(), time.process_time()
    for topic, frame in frames:
        transport.publish(topic, frame)
    target = acks_before + len(frames)
    end = watch.wait(lambda: watch.acks >= target, timeout_s, "acks")
    return end - start, time.process_time() - cpu


def state_root() -> Path | None:
    """Where the state directory goes: ``/dev/shm`` where there is one (memory-backed on
    Linux), else the system's temporary folder (None)."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else None


def measure(
    devices: int,
    *,
    fsync: bool = False,
    batch: int = 10_000,
    root: Path | None = None,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    """Run one round of ``devices`` devices through a real coordinator; see the module
    docstring for the figures it returns.

    Raises:
        RuntimeError: an update or a hello was refused, or the run did not finish.
        TimeoutError: the coordinator stopped answering.
    """
    if devices < 2:
        raise ValueError("need at least 2 devices (the last one's events are timed apart)")
    ids = [f"dev-{i:06d}" for i in range(devices)]
    keys = Keyring({d: new_key() for d in ids})
    topics = Topics(FLEET)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="coordinator-scale-", dir=root) as tmp:
        config = CoordinatorConfig(
            fleet=FLEET,
            model=MODEL,
            image_size=IMAGE_SIZE,
            rounds=1,
            participation=1.0,
            min_devices=devices,
            round_timeout_s=timeout_s,
            state_dir=Path(tmp),
            export_onnx=False,
            seed=0,
        )
        (template,) = build_models(config).values()
        architecture, fingerprint = template.architecture, template.fingerprint()
        broker = MemoryBroker()
        coordinator = Coordinator(
            config,
            MemoryTransport(broker, "coordinator"),
            FileStore(Path(tmp) / "state", fsync=fsync),
            keyring=keys,
        )
        watch = _Watch()
        coordinator.add_observer(watch)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                coordinator.run()
            except BaseException as exc:  # surfaced on the benchmark's thread
                errors.append(exc)
                with watch._cond:
                    watch._cond.notify_all()

        thread = threading.Thread(target=run, name="coordinator", daemon=True)
        thread.start()
        sender = MemoryTransport(broker, "devices")
        sender.connect()
        channel = Channel(sender, auth=keys)
        try:
            watch.wait(lambda: watch.ready or bool(errors), 60.0, "the coordinator")
            hellos = [
                (
                    topic := topics.device(d, "hello"),
                    channel.encode(topic, _hello(d, architecture, fingerprint)),
                )
                for d in ids
            ]
            hello_s, hello_cpu_s = _feed(sender, hellos[:-1], watch, 0, timeout_s)
            last_hello = time.perf_counter()
            sender.publish(*hellos[-1])
            watch.wait(lambda: watch.round_started is not None or bool(errors), timeout_s, "round")
            assert watch.round_started is not None
            round_start_s = watch.round_started - last_hello
            del hellos
            model = coordinator.engine.models()[MODEL]["aca"]
            update_s = update_cpu_s = 0.0
            frame_bytes = 0
            for first in range(0, devices - 1, batch):
                chunk = ids[first : min(first + batch, devices - 1)]
                frames = []
                for d in chunk:
                    topic = topics.device(d, "update")
                    frames.append((topic, channel.encode(topic, _update(d, model, rng))))
                frame_bytes = len(frames[-1][1])
                wall_s, cpu_s = _feed(sender, frames, watch, watch.acks, timeout_s)
                update_s, update_cpu_s = update_s + wall_s, update_cpu_s + cpu_s
            topic = topics.device(ids[-1], "update")
            last = channel.encode(topic, _update(ids[-1], model, rng))
            before = watch.acks
            last_update = time.perf_counter()
            sender.publish(topic, last)
            close_s = watch.wait(lambda: watch.acks > before, timeout_s, "last ack") - last_update
            watch.wait(lambda: watch.finished is not None or bool(errors), timeout_s, "finish")
            thread.join(timeout_s)
        finally:
            coordinator.stop()
            sender.disconnect()
        if errors:
            raise RuntimeError(f"the coordinator failed: {errors[0]}") from errors[0]
        if watch.refused:
            raise RuntimeError(f"{len(watch.refused)} refused, first: {watch.refused[0]}")
        assert watch.finished is not None and watch.closed is not None
        if watch.closed.on_time != devices:
            raise RuntimeError(f"aggregated {watch.closed.on_time} of {devices} updates")
    return {
        "devices": devices,
        "us_per_update": 1e6 * update_s / (devices - 1),
        "cpu_us_per_update": 1e6 * update_cpu_s / (devices - 1),
        "us_per_hello": 1e6 * hello_s / (devices - 1),
        "cpu_us_per_hello": 1e6 * hello_cpu_s / (devices - 1),
        "round_start_s": round_start_s,
        "close_s": close_s,
        "finish_s": watch.finished - last_update,
        "aggregate_s": watch.closed.aggregate_s,
        "update_frame_bytes": frame_bytes,
        "model": f"{MODEL} {IMAGE_SIZE}x{IMAGE_SIZE}",
        "fsync": fsync,
    }


def coordinator_rows(
    sizes: Sequence[int], *, fsync: bool = False, batch: int = 10_000
) -> list[dict[str, Any]]:
    """One row of :func:`measure` per fleet size, smallest first, the state directory
    under :func:`state_root`."""
    return [measure(n, fsync=fsync, batch=batch, root=state_root()) for n in sorted(sizes)]


def flatness(rows: Sequence[dict[str, Any]], field: str = "us_per_update") -> float:
    """``field`` of the largest fleet over that of the smallest."""
    ordered = sorted(rows, key=lambda r: r["devices"])
    return float(ordered[-1][field] / ordered[0][field])


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| devices | us/update | CPU us/update | us/hello | CPU us/hello | round start s "
        "| close s | finish s | aggregate s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['devices']:,} | {r['us_per_update']:.0f} | {r['cpu_us_per_update']:.0f} "
        f"| {r['us_per_hello']:.0f} | {r['cpu_us_per_hello']:.0f} "
        f"| {r['round_start_s']:.2f} | {r['close_s']:.3f} | {r['finish_s']:.2f} "
        f"| {r['aggregate_s']:.2f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--devices",
        default=",".join(str(n) for n in DEFAULT_SIZES),
        help="fleet sizes, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--fsync", action="store_true", help="fsync every store write")
    parser.add_argument("--batch", type=int, default=10_000, help="frames built per batch")
    parser.add_argument(
        "--tmp",
        type=Path,
        help="folder for the state directory (default: /dev/shm where there is one, so "
        "the figures are the coordinator's work, not the disk's; else the system's)",
    )
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    args = parser.parse_args(argv)
    sizes = [int(n.replace("_", "")) for n in args.devices.split(",")]
    root = args.tmp if args.tmp is not None else state_root()
    print(f"state directory under {root or tempfile.gettempdir()}, fsync {args.fsync}")
    rows = []
    for n in sorted(sizes):
        rows.append(measure(n, fsync=args.fsync, batch=args.batch, root=root))
        print(f"{n:,} devices: {rows[-1]['us_per_update']:.0f} us per update", flush=True)
    print(table(rows))
    if len(rows) > 1:
        for field in ("us_per_update", "cpu_us_per_update"):
            ratio = flatness(rows, field)
            verdict = "within" if ratio <= 2.0 else "NOT within"
            print(
                f"{field}, {rows[-1]['devices']:,} vs {rows[0]['devices']:,} devices: "
                f"{ratio:.2f}x ({verdict} 2x)"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
