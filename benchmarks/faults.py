"""Fault injection: the coordinator SIGKILLed at random points and resumed (issue 17).

A private Mosquitto, N ``python -m edge_client`` processes on synthetic data (``--model
mlp``, authenticated with per-device keys) and one ``python -m coordinator`` with a state
dir. The coordinator is killed with SIGKILL at seeded random moments and restarted with
``--resume`` each time until it finishes its rounds. A monitor MQTT client, holding the
keyring, records every acknowledgement the coordinator sends (the event log).

Checks, against an uninterrupted reference run of the same seed on the same data:

* the interrupted run finishes (exit 0, final models saved);
* its final models are bit-identical to the reference's;
* per round, the updates the coordinator aggregated (the round's close in its status file,
  ``STATE_DIR/status.json``) equal the distinct updates it acknowledged as accepted: ``lost`` counts
  acknowledged-accepted updates missing from a round, ``twice`` updates counted beyond
  those acknowledged, ``delayed`` updates a round lacked.

Then the device and broker scenarios of :mod:`benchmarks.fault_scenarios` run (a device
cut mid chunked upload, duplicated / shuffled / late chunks, a silent device, devices
joining and leaving; skip them with ``--no-scenarios``), and one table gives a row per run
(faults injected by kind, rounds completed, updates tried, acknowledged, rejected, lost,
counted twice, honest updates delayed) and their totals.

Run::

    python -m benchmarks.faults            # 4 devices, 30 rounds, 20 kills; the scenarios
    python -m benchmarks.faults --quick    # 4 devices, 8 rounds, 5 kills; the scenarios
    python -m benchmarks.faults --json     # the same figures as one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
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

from benchmarks.fault_scenarios import FLEET, ScenarioReport, run_scenarios
from benchmarks.harness import (
    MLP_FEDAVG,
    Status,
    coordinator_command,
    final_models,
    identical,
    private_broker,
    processes,
    spawn,
    start_devices,
    wait_status,
    write_fleet,
)
from protocol.auth import Keyring
from protocol.channel import Channel
from protocol.messages import Ack, Message, Update
from protocol.topics import Topics
from protocol.transport.config import MqttConfig
from protocol.transport.mqtt import MqttTransport


@dataclass(frozen=True)
class FaultConfig:
    """One benchmark run."""

    devices: int = 4
    """Edge-client processes."""
    rounds: int = 30
    """Rounds of the federated run."""
    kills: int = 20
    """SIGKILLs of the coordinator (fewer if the run finishes first)."""
    seed: int = 0
    """Seed of the run (coordinator and devices) and of the kill times."""
    kill_after: tuple[float, float] = (0.05, 0.9)
    """A kill comes this many seconds (uniform) after the coordinator has started its run."""
    broker_restarts: int = 0
    """Mosquitto restarts in the middle of the interrupted run."""
    timeout_s: float = 900.0
    """Give up on a run after this long."""


@dataclass
class FaultReport:
    """What one benchmark run measured."""

    devices: int
    rounds: int
    kills: int = 0
    restarts: int = 0
    broker_restarts: int = 0
    kill_phases: dict[str, int] = field(default_factory=dict)
    """Kills by the phase the coordinator's status file said: ``training`` (starting or
    collecting updates), ``aggregating`` (between the aggregation's request and the
    round's close), ``closed`` (just after a round closed)."""
    rounds_completed: int = 0
    finished: bool = False
    updates_tried: int = 0
    """Updates the devices sent (message ids seen on the update topics, resends included)."""
    updates_acknowledged: int = 0
    """Distinct (device, round) updates the coordinator acknowledged as accepted."""
    updates_rejected: int = 0
    """Acknowledgements with accepted = false (duplicates of resends among them)."""
    lost: int = 0
    """Acknowledged-accepted updates missing from their round's aggregate."""
    twice: int = 0
    """Updates a round aggregated beyond the distinct ones it acknowledged."""
    delayed: int = 0
    """Updates the checked rounds lacked (every device is selected every round)."""
    rounds_unchecked: int = 0
    """Rounds whose close left no status entry (the kill came between the round's commit
    and the status file's write)."""
    identical_to_reference: bool = False
    wall_s: float = 0.0
    reference_wall_s: float = 0.0
    coordinator_peak_rss_mb: float | None = None
    problems: list[str] = field(default_factory=list)


class AckLog:
    """The event log: every acknowledgement and update seen on the broker, decoded with the
    keyring (frames that fail authentication are dropped by the channel)."""

    def __init__(self, url: str, keyring: Keyring) -> None:
        self._lock = threading.Lock()
        self.acks: list[tuple[str, int, str | None, bool]] = []  # device, round, ref, accepted
        self.update_rounds: dict[str, int] = {}  # update message id -> round
        self._transport = MqttTransport(MqttConfig.from_url(url, client_id="faults-monitor"))
        self._channel = Channel(self._transport, auth=keyring)
        self._topics = Topics(FLEET)

    def start(self) -> None:
        self._transport.connect()
        self._channel.subscribe(f"{self._topics.root}/to/+/ack", self._on_ack)
        self._channel.subscribe(self._topics.from_devices("update"), self._on_update)

    def stop(self) -> None:
        self._transport.disconnect()

    def _on_ack(self, topic: str, message: Message) -> None:
        if isinstance(message.body, Ack):
            device = topic.split("/")[-2]
            with self._lock:
                self.acks.append((device, message.round, message.body.ref, message.body.accepted))

    def _on_update(self, topic: str, message: Message) -> None:
        if isinstance(message.body, Update):
            with self._lock:
                self.update_rounds[message.message_id] = message.round

    def accepted(self) -> dict[int, set[str]]:
        """Round -> devices whose update of that round was acknowledged as accepted."""
        out: dict[int, set[str]] = defaultdict(set)
        with self._lock:
            for device, _, ref, ok in self.acks:
                if ok and ref in self.update_rounds:  # hellos are acknowledged too
                    out[self.update_rounds[ref]].add(device)
        return out

    def update_acks(self) -> list[tuple[str, int, str | None, bool]]:
        """The acknowledgements of updates (not of hellos)."""
        with self._lock:
            return [a for a in self.acks if a[2] in self.update_rounds]

    def save(self, path: Path) -> None:
        """Write the event log, one JSON object a line."""
        with self._lock, path.open("w") as out:
            for device, round_number, ref, ok in self.acks:
                event = {"event": "ack", "device": device, "round": round_number}
                event |= {"ref": ref, "accepted": ok}
                event["update_round"] = self.update_rounds.get(ref or "")
                out.write(json.dumps(event) + "\n")


def start_coordinator(
    url: str, cfg: FaultConfig, state: Path, keys: Path, log: Path, *, resume: bool
) -> subprocess.Popen[bytes]:
    extra = [*MLP_FEDAVG, "--seed", str(cfg.seed), *(["--resume"] if resume else [])]
    command = coordinator_command(
        url, FLEET, rounds=cfg.rounds, min_devices=cfg.devices, state=state, keys=keys,
        extra=extra,
    )  # fmt: skip
    return spawn(command, log)


def _phase(status: Status | None) -> str:
    """Where a coordinator was when it was killed, from its status file."""
    phase = "training" if status is None else status.phase
    return phase if phase in ("aggregating", "closed") else "training"


def one_run(
    url: str, cfg: FaultConfig, files: list[Path], keys: Path, work: Path, *, faults: bool,
    broker: Any = None,
) -> tuple[FaultReport, str]:  # fmt: skip
    """One run from scratch; with ``faults``, the coordinator is killed ``cfg.kills`` times
    (and the broker restarted ``cfg.broker_restarts`` times). Returns its report, counts
    checked (:func:`check`), and the end of the last coordinator's log."""
    work.mkdir(parents=True)
    state = work / "state"
    report = FaultReport(devices=cfg.devices, rounds=cfg.rounds)
    rng = random.Random(cfg.seed)
    monitor = AckLog(url, Keyring.load(keys))
    monitor.start()
    start = time.monotonic()
    try:
        with processes() as started:
            started.extend(start_devices(url, files, work / "devices", cfg.seed, fleet=FLEET))
            incarnation = 0
            while True:
                log = work / f"coordinator-{incarnation}.log"
                server = start_coordinator(url, cfg, state, keys, log, resume=incarnation > 0)
                started.append(server)
                incarnation += 1
                if faults and report.kills < cfg.kills:
                    if wait_status(state, server, lambda _: True, 120) is not None:
                        time.sleep(rng.uniform(*cfg.kill_after))
                        if (
                            broker is not None
                            and report.broker_restarts < cfg.broker_restarts
                            and report.kills == cfg.kills // 2
                        ):
                            broker.restart()  # mid-run, while this coordinator works
                            report.broker_restarts += 1
                    if server.poll() is None:
                        server.send_signal(signal.SIGKILL)
                        server.wait(10)
                        report.kills += 1
                        report.restarts += 1
                        phase = _phase(Status.read(state))
                        report.kill_phases[phase] = report.kill_phases.get(phase, 0) + 1
                        continue
                try:
                    server.wait(cfg.timeout_s - (time.monotonic() - start))
                except subprocess.TimeoutExpired:
                    report.problems.append("the coordinator did not finish in time")
                break
            report.finished = server.returncode == 0 and (state / "final" / "aca.pt").exists()
            for device in started[: cfg.devices]:
                try:
                    device.wait(30)
                except subprocess.TimeoutExpired:
                    report.problems.append(f"device pid {device.pid} did not exit")
    finally:
        monitor.stop()
        monitor.save(work / "events.jsonl")
    report.wall_s = time.monotonic() - start
    if not report.finished:
        report.problems.append(f"the coordinator ended with {server.returncode}")
    status = Status.read(state)
    report.coordinator_peak_rss_mb = None if status is None else status.peak_rss_mb
    check(report, monitor, status, cfg)
    return report, log.read_text(errors="replace")[-3000:]


def check(report: FaultReport, monitor: AckLog, status: Status | None, cfg: FaultConfig) -> None:
    """Fill in the counts of ``report`` from the event log and the coordinator's status
    file (a round closed again after a kill: its later close counts)."""
    closed = {} if status is None else status.closed
    aggregated = {r: close.on_time for r, close in closed.items()}
    accepted = monitor.accepted()
    # a finished run (exit 0, final models saved) completed every round, also one whose
    # last close left no status entry (a kill between the round's commit and its write)
    report.rounds_completed = (
        cfg.rounds if report.finished else max((r for r in aggregated), default=0)
    )
    report.updates_tried = len(monitor.update_rounds)
    report.updates_acknowledged = sum(len(devices) for devices in accepted.values())
    report.updates_rejected = sum(1 for *_, ok in monitor.update_acks() if not ok)
    for r in range(1, cfg.rounds + 1):
        acked = len(accepted.get(r, ()))
        if r not in aggregated:
            report.rounds_unchecked += 1
            continue
        report.lost += max(0, acked - aggregated[r])
        report.twice += max(0, aggregated[r] - acked)
        report.delayed += max(0, cfg.devices - aggregated[r])


def run_benchmark(cfg: FaultConfig, work: Path) -> FaultReport:
    """Reference run, then the same run with faults; returns the report of the latter."""
    files, keys = write_fleet(work / "fleet", cfg.devices, cfg.seed)
    with private_broker(work, "faults") as broker:
        reference, tail = one_run(broker.url, cfg, files, keys, work / "reference", faults=False)
        if not reference.finished:
            raise RuntimeError(f"the reference run failed: {reference.problems}\n{tail}")
        report, _ = one_run(
            broker.url, cfg, files, keys, work / "faults", faults=True, broker=broker
        )
    report.reference_wall_s = reference.wall_s
    if report.finished:
        report.identical_to_reference = identical(
            final_models(work / "faults" / "state"), final_models(work / "reference" / "state")
        )
    return report


_COLUMNS = (
    "rounds_completed", "updates_tried", "updates_acknowledged", "updates_rejected", "lost",
    "twice", "delayed",
)  # fmt: skip


def kill_faults(report: FaultReport) -> dict[str, int]:
    """The faults of the coordinator-kill run, by kind."""
    return {"coordinator_kill": report.kills, "broker_restart": report.broker_restarts}


def summary(report: FaultReport, scenarios: Sequence[ScenarioReport] = ()) -> dict[str, Any]:
    """Faults injected by kind, and the counts of every run added up."""
    faults: dict[str, int] = dict(kill_faults(report))
    for scenario in scenarios:
        for kind, n in scenario.faults.items():
            faults[kind] = faults.get(kind, 0) + n
    rows = [asdict(report), *(asdict(s) for s in scenarios)]
    totals: dict[str, Any] = {"faults": faults}
    totals |= {column: sum(row[column] for row in rows) for column in _COLUMNS}
    totals["all_finished"] = all(row["finished"] for row in rows)
    return totals


def markdown(report: FaultReport, scenarios: Sequence[ScenarioReport] = ()) -> str:
    """One table: a row for the coordinator-kill run, one per scenario, and the totals."""
    head = ["run", "faults injected", *_COLUMNS, "finished", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]

    def row(name: str, faults: dict[str, int], counts: dict[str, Any], notes: str) -> None:
        injected = ", ".join(f"{kind} {n}" for kind, n in faults.items() if n)
        cells = [name, injected, *(str(counts[c]) for c in _COLUMNS)]
        lines.append("| " + " | ".join([*cells, str(counts["finished"]), notes]) + " |")

    phases = ", ".join(f"{n} {phase}" for phase, n in sorted(report.kill_phases.items()))
    notes = [
        f"kills by phase: {phases or 'none'}",
        f"bit-identical to the reference: {report.identical_to_reference}",
        f"{report.wall_s:.0f} s (reference {report.reference_wall_s:.0f} s)",
    ]
    if report.coordinator_peak_rss_mb is not None:
        notes.append(f"coordinator peak RSS {report.coordinator_peak_rss_mb:.0f} MB")
    if report.rounds_unchecked:
        notes.append(f"{report.rounds_unchecked} round(s) unchecked")
    notes += report.problems
    row("coordinator_kill", kill_faults(report), asdict(report), "; ".join(notes))
    for scenario in scenarios:
        row(scenario.kind, scenario.faults, asdict(scenario), "; ".join(
            [f"{scenario.wall_s:.0f} s", *scenario.problems]
        ))  # fmt: skip
    if scenarios:
        totals = summary(report, scenarios)
        row("total", totals["faults"], {**totals, "finished": totals["all_finished"]}, "")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="8 rounds, 5 kills (minutes)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--devices", type=int, help="edge clients (default 4)")
    p.add_argument("--rounds", type=int, help="rounds (default 30; --quick 8)")
    p.add_argument("--kills", type=int, help="coordinator SIGKILLs (default 20; --quick 5)")
    p.add_argument("--broker-restarts", type=int, default=0, help="Mosquitto restarts (0)")
    p.add_argument("--seed", type=int, default=0, help="default 0")
    p.add_argument("--work-dir", type=Path, help="keep the files here (default: a temp dir)")
    p.add_argument(
        "--no-scenarios",
        action="store_true",
        help="skip the device and broker fault scenarios (benchmarks/fault_scenarios.py)",
    )
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    cfg = FaultConfig(
        devices=args.devices or 4,
        rounds=args.rounds or (8 if args.quick else 30),
        kills=args.kills if args.kills is not None else (5 if args.quick else 20),
        seed=args.seed,
        broker_restarts=args.broker_restarts,
    )
    with ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(TemporaryDirectory(prefix="faults-")))
        report = run_benchmark(cfg, work)
        scenarios = [] if args.no_scenarios else run_scenarios(work / "scenarios", args.seed)
    if args.json:
        out = asdict(report) | {"scenarios": [asdict(s) for s in scenarios]}
        print(json.dumps(out | {"totals": summary(report, scenarios)}, indent=2))
    else:
        print(markdown(report, scenarios))
    ok = report.finished and report.identical_to_reference and not (report.lost or report.twice)
    ok = ok and all(s.finished and not (s.lost or s.twice or s.delayed) for s in scenarios)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
