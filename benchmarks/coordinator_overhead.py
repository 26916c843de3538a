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
- the coordinator's peak RSS (it logs it at exit).

Run from the repository root: ``python -m benchmarks.coordinator_overhead [--devices 50]
[--rounds 4] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from protocol.auth import Keyring, new_key, write_key_file
from protocol.channel import Channel
from protocol.messages import Message
from protocol.topics import parse_topic
from protocol.transport import MqttConfig, MqttTransport
from sim.datasets import load_dataset
from sim.partition import partition_dataset, save_device_file

FLEET = "bench"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_mosquitto(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(binary).exists():
        sys.exit("this benchmark needs mosquitto (apt-get install mosquitto)")
    port = free_port()
    config = workdir / "mosquitto.conf"
    config.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n")
    process = subprocess.Popen([binary, "-c", str(config)], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, f"mqtt://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    process.kill()
    sys.exit("mosquitto did not start")


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
        broker, url = start_mosquitto(root)
        processes: list[subprocess.Popen[str]] = []
        try:
            federation = partition_dataset(
                load_dataset("synthetic", seed=0), args.devices, float("inf"), seed=0
            )
            files = []
            keys = {}
            for split in federation.devices:
                files.append(root / f"{split.device_id}.npz")
                save_device_file(files[-1], split)
                keys[split.device_id] = new_key()
                write_key_file(root / f"{split.device_id}.key", keys[split.device_id])
            Keyring(keys).save(root / "keys.json")  # every message authenticated, as deployed
            monitor = Monitor(url)
            monitor.start()
            coordinator = subprocess.Popen(
                [sys.executable, "-m", "coordinator", "--broker", url, "--fleet", FLEET,
                 "--model", "lenet5", "--rounds", str(args.rounds), "--participation", "1.0",
                 "--min-devices", str(args.devices), "--local-epochs", "1",
                 "--round-timeout", "600", "--no-onnx", "--state-dir", str(root / "state"),
                 "--device-keys", str(root / "keys.json")],
                stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            processes.append(coordinator)
            started = time.monotonic()
            for path in files:
                processes.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "edge_client",
                            "--broker",
                            url,
                            "--fleet",
                            FLEET,
                            "--data",
                            str(path),
                            "--state-dir",
                            str(root / "dev" / path.stem),
                            "--threads",
                            "1",
                            "--auth-key-file",
                            str(path.with_suffix(".key")),
                            "--exit-when-finished",
                        ],
                        stderr=subprocess.DEVNULL,
                        text=True,
                    )
                )
            print(f"started the coordinator and {args.devices} edge clients", file=sys.stderr)
            _, log = coordinator.communicate(timeout=3600)
            total_s = time.monotonic() - started
            for process in processes[1:]:
                process.wait(timeout=120)
            rss = re.search(r"peak RSS ([\d.]+) MB", log)
            if coordinator.returncode != 0:
                sys.exit(f"coordinator failed ({coordinator.returncode}):\n{log[-3000:]}")
            rows = monitor.rounds(args.rounds)
            monitor.transport.disconnect()
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
            broker.terminate()
            broker.wait(5)

    dispatch = [r["dispatch_s"] for r in rows if r["dispatch_s"] is not None]
    aggregate = [r["aggregate_s"] for r in rows if r["aggregate_s"] is not None]
    result = {
        "devices": args.devices,
        "rounds": rows,
        "dispatch_s_median": statistics.median(dispatch) if dispatch else None,
        "aggregate_s_median": statistics.median(aggregate) if aggregate else None,
        "coordinator_peak_rss_mb": float(rss.group(1)) if rss else None,
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
