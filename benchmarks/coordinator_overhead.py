"""Coordinator overhead against Mosquitto with many separate edge-client processes.

Starts a private Mosquitto (the ``mosquitto`` binary must be installed), writes one
synthetic-data file per device, then runs ``python -m coordinator`` and ``--devices``
``python -m edge_client`` processes (LeNet-5, every device selected every round, one local
epoch). A monitor client subscribed to the fleet's topics timestamps every message with
one clock and reports, per round:

- ``dispatch_s``: from the first model message of the round to the last task delivered
  (all selected devices have their model and task);
- ``aggregate_s``: from the last update of the round to the first model message of the
  next round (the coordinator validated, stored and averaged the updates, and published
  the new aggregate); none for the last round;
- the coordinator's peak RSS (its status file's, written at exit).

Run from the repository root: ``python -m benchmarks.coordinator_overhead [--devices 50]
[--rounds 4] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    Status,
    coordinator_command,
    edge_client_command,
    private_broker,
    processes,
    spawn,
    write_fleet,
)
from protocol.channel import Channel
from protocol.messages import Message
from protocol.topics import parse_topic
from protocol.transport import MqttConfig, MqttTransport

FLEET = "bench"


class Monitor:
    """Timestamps (monotonic, s) of the fleet's messages by round and kind."""

    def __init__(self, url: str) -> None:
        self.transport = MqttTransport(MqttConfig.from_url(url, client_id="bench-monitor"))
        self.events: list[tuple[float, int, str, str]] = []  # (t, round, leaf, device)
        self._lock = threading.Lock()

    def start(self) -> None:
        self.transport.connect()
        channel = Channel(self.transport)
        channel.subscribe(f"fl/{FLEET}/to/#", self._record)
        channel.subscribe(f"fl/{FLEET}/devices/+/update", self._record)

    def _record(self, topic: str, message: Message) -> None:
        info = parse_topic(topic)
        with self._lock:
            self.events.append((time.monotonic(), message.round, info.leaf, info.device_id or ""))

    def rounds(self, total: int) -> list[dict[str, Any]]:
        with self._lock:
            events = list(self.events)
        out = []
        for r in range(1, total + 1):
            models = [t for t, rr, leaf, _ in events if rr == r and leaf == "model"]
            tasks = [t for t, rr, leaf, _ in events if rr == r and leaf == "task"]
            updates = [t for t, rr, leaf, _ in events if rr == r and leaf == "update"]
            following = [t for t, rr, leaf, _ in events if rr == r + 1 and leaf == "model"]
            row: dict[str, Any] = {"round": r, "tasks": len(tasks), "updates": len(updates)}
            row["dispatch_s"] = max(tasks) - min(models) if models and tasks else None
            if updates and following:
                row["aggregate_s"] = min(following) - max(updates)
            else:
                row["aggregate_s"] = None
            out.append(row)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="edgefl-bench-") as tmp:
        root = Path(tmp)
        with private_broker(root, "coordinator_overhead") as broker, processes() as started:
            url = broker.url
            # every message authenticated, as deployed
            files, keys = write_fleet(root, args.devices, seed=0)
            monitor = Monitor(url)
            monitor.start()
            command = coordinator_command(
                url, FLEET, rounds=args.rounds, min_devices=args.devices,
                state=root / "state", keys=keys, round_timeout_s=600,
                extra=["--model", "lenet5", "--local-epochs", "1", "--no-onnx"],
            )  # fmt: skip
            coordinator = spawn(command, root / "coordinator.log", one_thread=False)
            started.append(coordinator)
            start = time.monotonic()
            for path in files:
                command = edge_client_command(
                    url, FLEET, path, root / "dev" / path.stem, ("--threads", "1")
                )
                started.append(spawn(command, root / f"{path.stem}.log", one_thread=False))
            print(f"started the coordinator and {args.devices} edge clients", file=sys.stderr)
            coordinator.wait(timeout=3600)
            total_s = time.monotonic() - start
            for process in started[1:]:
                process.wait(timeout=120)
            if coordinator.returncode != 0:
                log = (root / "coordinator.log").read_text(errors="replace")
                sys.exit(f"coordinator failed ({coordinator.returncode}):\n{log[-3000:]}")
            rows = monitor.rounds(args.rounds)
            monitor.transport.disconnect()
            status = Status.read(root / "state")

    dispatch = [r["dispatch_s"] for r in rows if r["dispatch_s"] is not None]
    aggregate = [r["aggregate_s"] for r in rows if r["aggregate_s"] is not None]
    result = {
        "devices": args.devices,
        "rounds": rows,
        "dispatch_s_median": statistics.median(dispatch) if dispatch else None,
        "aggregate_s_median": statistics.median(aggregate) if aggregate else None,
        "coordinator_peak_rss_mb": None if status is None else status.peak_rss_mb,
        "total_s": total_s,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{args.devices} edge-client processes, LeNet-5, Mosquitto, all devices every round")
    print("round  tasks  updates  dispatch_s  aggregate_s")
    for r in rows:
        agg = "-" if r["aggregate_s"] is None else f"{r['aggregate_s']:.3f}"
        disp = "-" if r["dispatch_s"] is None else f"{r['dispatch_s']:.3f}"
        print(f"{r['round']:5d}  {r['tasks']:5d}  {r['updates']:7d}  {disp:>10}  {agg:>11}")
    print(
        f"median dispatch {result['dispatch_s_median']:.3f} s, median aggregate "
        f"{result['aggregate_s_median']:.3f} s, coordinator peak RSS "
        f"{result['coordinator_peak_rss_mb']} MB, total {total_s:.0f} s"
    )


if __name__ == "__main__":
    main()
