"""Scale and load against Mosquitto: round overhead, coordinator memory, broker throughput
(issue 17).

A private Mosquitto; the coordinator as its own process (``python -m coordinator``, with
a state dir and a keyring of one key per registered device); every registered device
emulated by ``python -m sim devices`` in one other process over a pool of broker
connections (the sim's fleet: each device its own session, id, topics and key); a monitor
client that counts what goes through the broker and decodes the acknowledgements.

Scenario A (default: 1,000 registered devices, 100 selected per round, LeNet-5, int8 both
ways, 20 rounds, a few local steps on synthetic data) measures per round:

* ``wall_s``: the coordinator's round time, from the round's start (devices selected) to
  its close (updates aggregated and stored), from the round's close in its status file
  (``STATE_DIR/status.json``);
* ``devices_s``: the seconds the devices' trainer spent on that round's jobs (decoding the
  models received, training, encoding the updates), one batch after another in the
  devices' process (``sim devices`` reports them);
* ``overhead_s = wall_s - devices_s``: what the round costs beyond the devices' own
  compute: MQTT transfers, the coordinator's validation, screening, aggregation and
  storage, scheduling and the emulation's batching delay (both processes and the broker
  share the machine's cores);

and for the run: the coordinator's peak RSS (its status file's, written at exit), broker throughput
(messages and MB published into the broker per second between the first task and the
last acknowledgement, counted by the monitor subscribed to ``fl/FLEET/#``), and updates
acknowledged as accepted against updates aggregated: ``lost`` = acknowledged but missing
from their round's aggregate, ``twice`` = aggregated beyond those acknowledged.

Scenario B (default: 1,000 / 5,000 / 10,000 registered devices, all online, 20 selected
per round, 2 rounds, FedGen's CNN at 8x8 pixels, 3,350 parameters) measures the
coordinator's peak RSS at each fleet size: ``mb_per_1000_devices`` is the slope between the
smallest and the largest fleet.

Run::

    python -m benchmarks.load            # A: 1,000 / 100 / 20 rounds; B: 1k, 5k, 10k
    python -m benchmarks.load --quick    # A: 200 / 20 / 3 rounds; B: 500, 1k, 2k
    python -m benchmarks.load --json     # the same figures as one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

from benchmarks.harness import Status, coordinator_command, private_broker, spawn, stop
from protocol.auth import Keyring, new_key
from protocol.channel import Channel
from protocol.messages import Ack, Message
from protocol.signing import SigningKey
from protocol.topics import Topics
from protocol.transport import Inbound, MqttConfig, MqttTransport

FLEET = "load"
OVERHEAD = (
    "overhead_s = wall_s - devices_s; wall_s: the coordinator's round, from selection to "
    "the aggregate stored; devices_s: the devices' trainer busy with the round's jobs "
    "(decode, train, encode)"
)


@dataclass(frozen=True)
class LoadConfig:
    """One fleet run: a coordinator and its registered devices."""

    devices: int = 1000
    """Registered devices (keys), all of them emulated and online."""
    per_round: int = 100
    """Devices selected per round."""
    rounds: int = 20
    model: str = "lenet5"
    precision: str = "int8"
    """Transfer precision both ways."""
    local_steps: int = 5
    batch_size: int = 16
    image_size: int = 28
    samples_per_device: int = 100
    """Synthetic samples per device (train + local test)."""
    connections: int = 16
    """Broker connections of the devices' process."""
    engine: str = "auto"
    seed: int = 0
    round_timeout_s: float = 300.0
    timeout_s: float = 3600.0


@dataclass
class RoundFigures:
    round: int
    selected: int
    aggregated: int
    acknowledged: int
    wall_s: float
    devices_s: float
    overhead_s: float
    server_step_s: float
    """The coordinator's aggregation (its status file's ``server_step_s``), part of the
    overhead."""


@dataclass
class RunFigures:
    """What one fleet run measured."""

    devices: int
    per_round: int
    rounds: int
    model: str
    precision: str
    finished: bool = False
    rounds_completed: int = 0
    updates_acknowledged: int = 0
    updates_aggregated: int = 0
    lost: int = 0
    twice: int = 0
    overhead_s_mean: float = 0.0
    overhead_s_median: float = 0.0
    overhead_s_max: float = 0.0
    round_wall_s_mean: float = 0.0
    devices_s_mean: float = 0.0
    server_step_s_mean: float = 0.0
    coordinator_peak_rss_mb: float = 0.0
    devices_peak_rss_mb: float = 0.0
    broker_messages: int = 0
    broker_mb: float = 0.0
    broker_messages_per_s: float = 0.0
    broker_mb_per_s: float = 0.0
    join_s: float = 0.0
    """From the devices' process start to the first round's start (its start-up, data
    generation and every device's enrolment)."""
    wall_s: float = 0.0
    per_round_figures: list[RoundFigures] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


class Monitor:
    """Counts every message published in the fleet's topic tree (with its arrival time)
    and decodes hellos and acknowledgements with the keyring."""

    def __init__(self, url: str, keyring: Keyring, fleet: str = FLEET) -> None:
        self._lock = threading.Lock()
        self.arrivals: list[tuple[float, int, str]] = []  # time, topic + payload bytes, leaf
        self.hellos: set[str] = set()
        self.acks: list[tuple[str, int, str | None, bool]] = []  # device, round, ref, accepted
        self._raw = MqttTransport(MqttConfig.from_url(url, client_id=f"{fleet}-monitor-raw"))
        self._acks = MqttTransport(MqttConfig.from_url(url, client_id=f"{fleet}-monitor-acks"))
        self._channel = Channel(self._acks, auth=keyring)
        self._topics = Topics(fleet)

    def start(self) -> None:
        self._raw.connect()
        self._raw.subscribe(f"{self._topics.root}/#", self._on_raw)
        self._acks.connect()
        self._channel.subscribe(f"{self._topics.root}/to/+/ack", self._on_ack)
        self._channel.subscribe(self._topics.from_devices("hello"), self._on_hello)

    def stop(self) -> None:
        self._raw.disconnect()
        self._acks.disconnect()

    def _on_raw(self, message: Inbound) -> None:
        size = len(message.topic.encode()) + len(message.payload)
        with self._lock:
            leaf = message.topic.rsplit("/", 1)[-1]
            self.arrivals.append((time.monotonic(), size, leaf))

    def _on_hello(self, topic: str, message: Message) -> None:
        with self._lock:
            self.hellos.add(message.message_id)

    def _on_ack(self, topic: str, message: Message) -> None:
        if isinstance(message.body, Ack):
            with self._lock:
                body = message.body
                self.acks.append((topic.split("/")[-2], message.round, body.ref, body.accepted))

    def accepted(self) -> dict[int, set[str]]:
        """Round -> devices whose update of that round was acknowledged as accepted."""
        out: dict[int, set[str]] = defaultdict(set)
        with self._lock:
            for device, round_number, ref, ok in self.acks:
                if ok and ref not in self.hellos:
                    out[round_number].add(device)
        return out

    def throughput(self) -> tuple[int, int, float]:
        """Messages and bytes published from the first task to the last acknowledgement,
        and that window's length in seconds."""
        with self._lock:
            arrivals = list(self.arrivals)
        tasks = [t for t, _, leaf in arrivals if leaf == "task"]
        acks = [t for t, _, leaf in arrivals if leaf == "ack"]
        if not tasks or not acks or acks[-1] <= tasks[0]:
            return 0, 0, 0.0
        start, end = tasks[0], acks[-1]
        inside = [size for t, size, _ in arrivals if start <= t <= end]
        return len(inside), sum(inside), end - start


def write_keys(path: Path, devices: int) -> Keyring:
    """A keyring of ``devices`` fresh keys, ids ``dev-00000`` ..., written to ``path``,
    and the coordinator's signing key beside it (``coordinator.key`` and its ``.pub``)."""
    keyring = Keyring({f"dev-{i:05d}": new_key() for i in range(devices)})
    keyring.save(path)
    SigningKey.generate().save(path.parent / "coordinator.key")
    return keyring


def fleet_coordinator_command(url: str, cfg: LoadConfig, keys: Path, state: Path) -> list[str]:
    """The coordinator of ``cfg``: every registered device must be online to start."""
    return coordinator_command(
        url, FLEET, rounds=cfg.rounds, min_devices=cfg.devices, state=state, keys=keys,
        participation=cfg.per_round / cfg.devices, round_timeout_s=cfg.round_timeout_s,
        extra=[
            "--strategy", "fedavg", "--model", cfg.model, "--precision", cfg.precision,
            "--local-steps", str(cfg.local_steps), "--batch-size", str(cfg.batch_size),
            "--image-size", str(cfg.image_size), "--seed", str(cfg.seed),
        ],
    )  # fmt: skip


def devices_command(url: str, cfg: LoadConfig, keys: Path, report: Path) -> list[str]:
    return [
        sys.executable, "-m", "sim", "devices", "--broker", url, "--device-keys", str(keys),
        "--coordinator-key-file", str(keys.parent / "coordinator.key.pub"),
        "--fleet", FLEET, "--model", cfg.model, "--seed", str(cfg.seed), "--alpha", "inf",
        "--samples-per-device", str(cfg.samples_per_device), "--image-size",
        str(cfg.image_size), "--connections", str(min(cfg.connections, cfg.devices)),
        "--engine", cfg.engine, "--timeout-s", str(cfg.timeout_s), "--json-out", str(report),
    ]  # fmt: skip


def run_fleet(url: str, cfg: LoadConfig, work: Path) -> RunFigures:
    """One run of ``cfg`` against the broker at ``url``; files go to ``work``."""
    work.mkdir(parents=True)
    keyring = write_keys(work / "keys.json", cfg.devices)
    figures = RunFigures(cfg.devices, cfg.per_round, cfg.rounds, cfg.model, cfg.precision)
    monitor = Monitor(url, keyring)
    monitor.start()
    coordinator_log, devices_log = work / "coordinator.log", work / "devices.log"
    start = time.monotonic()
    processes: list[subprocess.Popen[bytes]] = []
    try:
        command = fleet_coordinator_command(url, cfg, work / "keys.json", work / "state")
        coordinator = spawn(command, coordinator_log)
        processes.append(coordinator)
        command = devices_command(url, cfg, work / "keys.json", work / "devices.json")
        devices_started = time.time()
        devices = spawn(command, devices_log)
        processes.append(devices)
        try:
            coordinator.wait(max(1.0, cfg.timeout_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            figures.problems.append("the coordinator did not finish in time")
        try:
            devices.wait(60)
        except subprocess.TimeoutExpired:
            figures.problems.append("the devices did not stop after the run")
    finally:
        for process in processes:
            stop(process)
        monitor.stop()
    figures.wall_s = time.monotonic() - start
    figures.finished = coordinator.returncode == 0
    if not figures.finished:
        tail = coordinator_log.read_text(errors="replace")[-2000:]
        figures.problems.append(f"the coordinator ended with {coordinator.returncode}: {tail}")
    status = Status.read(work / "state")
    if status is None:
        figures.problems.append("the coordinator wrote no status file")
    else:
        if status.started_at:
            figures.join_s = status.started_at[min(status.started_at)] - devices_started
        _fill(figures, status, work / "devices.json", monitor)
    return figures


def _fill(figures: RunFigures, status: Status, devices_json: Path, monitor: Monitor) -> None:
    """Per-round and run figures from the coordinator's status file, the devices' report
    and the monitor."""
    work: dict[str, Any] = {}
    if devices_json.exists():
        report = json.loads(devices_json.read_text())
        work = report["rounds"]
        figures.devices_peak_rss_mb = report["peak_rss_bytes"] / 2**20
    else:
        figures.problems.append("the devices wrote no report")
    accepted = monitor.accepted()
    for r, close in sorted(status.closed.items()):
        wall, aggregated = close.duration_s, close.on_time
        acknowledged = len(accepted.get(r, ()))
        busy = float(work.get(str(r), {}).get("busy_s", 0.0))
        figures.per_round_figures.append(
            RoundFigures(
                r, status.selected.get(r, 0), aggregated, acknowledged, wall, busy,
                wall - busy, close.server_step_s,
            )
        )  # fmt: skip
        figures.lost += max(0, acknowledged - aggregated)
        figures.twice += max(0, aggregated - acknowledged)
    rows = figures.per_round_figures
    figures.rounds_completed = len(rows)
    figures.updates_acknowledged = sum(r.acknowledged for r in rows)
    figures.updates_aggregated = sum(r.aggregated for r in rows)
    if rows:
        overheads = [r.overhead_s for r in rows]
        figures.overhead_s_mean = statistics.fmean(overheads)
        figures.overhead_s_median = statistics.median(overheads)
        figures.overhead_s_max = max(overheads)
        figures.round_wall_s_mean = statistics.fmean(r.wall_s for r in rows)
        figures.devices_s_mean = statistics.fmean(r.devices_s for r in rows)
        figures.server_step_s_mean = statistics.fmean(r.server_step_s for r in rows)
    if status.peak_rss_mb is not None:
        figures.coordinator_peak_rss_mb = status.peak_rss_mb
    else:
        figures.problems.append("the coordinator recorded no peak RSS")
    messages, size, seconds = monitor.throughput()
    figures.broker_messages, figures.broker_mb = messages, size / 1e6
    if seconds > 0:
        figures.broker_messages_per_s = messages / seconds
        figures.broker_mb_per_s = size / 1e6 / seconds


@dataclass
class MemoryFigures:
    """Scenario B: the coordinator's peak RSS against registered devices."""

    model: str
    model_parameters: int
    model_mb: float
    """The model's fp32 size, MB."""
    points: list[dict[str, Any]] = field(default_factory=list)
    """One per fleet size: devices, coordinator_peak_rss_mb, rounds_completed, lost."""
    mb_per_1000_devices: float = 0.0
    """Peak RSS slope between the smallest and the largest fleet, MB per 1,000 devices."""


def model_parameters(model: str, image_size: int) -> int:
    from models import build_classifier

    net = build_classifier(model, num_classes=10, in_channels=1, image_size=image_size)
    return sum(p.numel() for p in net.parameters())


def scenario_b(url: str, sizes: Sequence[int], base: LoadConfig, work: Path) -> MemoryFigures:
    """The coordinator's peak RSS for each fleet size in ``sizes``."""
    params = model_parameters(base.model, base.image_size)
    out = MemoryFigures(base.model, params, params * 4 / 1e6)
    runs = []
    for size in sizes:
        cfg = LoadConfig(**{**asdict(base), "devices": size})
        run = run_fleet(url, cfg, work / f"b-{size}")
        runs.append(run)
        out.points.append(
            {
                "devices": size,
                "rounds": cfg.rounds,
                "coordinator_peak_rss_mb": run.coordinator_peak_rss_mb,
                "rounds_completed": run.rounds_completed,
                "lost": run.lost,
                "twice": run.twice,
                "join_s": run.join_s,
                "problems": run.problems,
            }
        )
    if len(runs) > 1 and sizes[-1] != sizes[0]:
        rise = runs[-1].coordinator_peak_rss_mb - runs[0].coordinator_peak_rss_mb
        out.mb_per_1000_devices = 1000 * rise / (sizes[-1] - sizes[0])
    return out


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_benchmark(
    a: LoadConfig | None, b_sizes: Sequence[int], b: LoadConfig, work: Path
) -> dict[str, Any]:
    """Scenario A (unless ``a`` is None) then B (unless ``b_sizes`` is empty), each run
    against one private Mosquitto; returns the figures as one JSON-ready dict."""
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "load_average_before": _load_average()},
        "overhead_definition": OVERHEAD,
    }
    with private_broker(work, "load") as broker:
        if a is not None:
            result["a"] = asdict(run_fleet(broker.url, a, work / "a"))
        if b_sizes:
            result["b"] = asdict(scenario_b(broker.url, b_sizes, b, work))
    result["machine"]["load_average_after"] = _load_average()
    return result


def ok(result: dict[str, Any]) -> bool:
    """Every run finished all its rounds, none lost or double-counted an update."""
    runs = ([result["a"]] if "a" in result else []) + result.get("b", {}).get("points", [])
    return bool(runs) and all(
        not (run["lost"] or run["twice"] or run["problems"])
        and run["rounds_completed"] == run["rounds"]
        for run in runs
    )


def table(result: dict[str, Any]) -> str:
    """The figures as one markdown table."""
    lines = ["| figure | value |", "|---|---|"]

    def row(name: str, value: Any) -> None:
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        lines.append(f"| {name} | {text} |")

    machine = result["machine"]
    row("cpus", machine["cpus"])
    row("load average before (1/5/15 min)", machine["load_average_before"])
    row("load average after (1/5/15 min)", machine["load_average_after"])
    a = result.get("a")
    if a is not None:
        for key, value in a.items():
            if key not in ("per_round_figures", "problems"):
                row(f"A {key}", value)
        if a["problems"]:
            row("A problems", "; ".join(a["problems"]))
    b = result.get("b")
    if b is not None:
        row("B model", f"{b['model']} ({b['model_parameters']} parameters, {b['model_mb']:.3f} MB)")
        for point in b["points"]:
            row(
                f"B coordinator peak RSS MB, {point['devices']} devices",
                point["coordinator_peak_rss_mb"],
            )
            row(
                f"B lost / twice, {point['devices']} devices", f"{point['lost']} / {point['twice']}"
            )
        row("B MB per 1,000 registered devices", b["mb_per_1000_devices"])
    lines.append(f"\n{OVERHEAD}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="A: 200/20/3 rounds; B: 500, 1k, 2k")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--devices", type=int, help="A: registered devices (1000; --quick 200)")
    p.add_argument("--per-round", type=int, help="A: devices per round (100; --quick 20)")
    p.add_argument("--rounds", type=int, help="A: rounds (20; --quick 3)")
    p.add_argument("--model", default="lenet5", help="A: model (lenet5)")
    p.add_argument("--precision", default="int8", help="A: transfer precision (int8)")
    p.add_argument("--local-steps", type=int, default=5, help="A: local steps per round (5)")
    p.add_argument("--connections", type=int, default=16, help="devices' connections (16)")
    p.add_argument("--engine", default="auto", help="devices' engine: auto, batched, loop")
    p.add_argument(
        "--b-devices",
        help="B: comma-separated fleet sizes (1000,5000,10000; --quick 500,1000,2000)",
    )
    p.add_argument("--b-rounds", type=int, default=2, help="B: rounds (2)")
    p.add_argument("--scenario", choices=("a", "b", "both"), default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", type=Path, help="keep the files here (default: a temp dir)")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    a = LoadConfig(
        devices=args.devices or (200 if args.quick else 1000),
        per_round=args.per_round or (20 if args.quick else 100),
        rounds=args.rounds or (3 if args.quick else 20),
        model=args.model,
        precision=args.precision,
        local_steps=args.local_steps,
        connections=args.connections,
        engine=args.engine,
        seed=args.seed,
    )
    if a.per_round > a.devices:
        p.error("--per-round cannot exceed --devices")
    sizes = [int(s) for s in (args.b_devices or "").split(",") if s.strip()]
    sizes = sizes or ([500, 1000, 2000] if args.quick else [1000, 5000, 10000])
    b = LoadConfig(
        per_round=min(20, *sizes),
        rounds=args.b_rounds,
        model="fedgen_cnn",
        precision="fp32",
        local_steps=2,
        image_size=8,
        samples_per_device=20,
        connections=args.connections,
        engine=args.engine,
        seed=args.seed,
    )
    with ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(TemporaryDirectory(prefix="load-")))
        result = run_benchmark(
            a if args.scenario != "b" else None, sizes if args.scenario != "a" else [], b, work
        )
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0 if ok(result) else 1


if __name__ == "__main__":
    sys.exit(main())
