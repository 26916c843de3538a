"""Abuse: a hostile client fuzzes a running coordinator on every topic it reads (issue 17).

A private Mosquitto (anonymous, no ACL: anyone may read and write every topic), one
``python -m coordinator`` (``-v``: every refusal leaves a log line, the first one of a
kind and source per minute at WARNING, the others at DEBUG) and N keyed ``python -m
edge_client`` processes run a seeded FedAvg job. A hostile MQTT client publishes, in
seeded bursts, one category of bad input at a time on the coordinator's topics
(``fl/{fleet}/devices/{id}/{hello,status,update}``) of the honest devices, of ids
without a key (unregistered), of a "rogue" id whose key the keyring holds but which
never says hello (so its bombs pass authentication and reach the decoder), and of
garbage ids outside the topic layout. It may read everything the broker carries and
replays what it saw (also frames it recorded during the reference run); it lives in
benchmarks/hostile.py.

Categories: ``random_bytes``, ``truncated``, ``bit_flipped`` (honest frames damaged),
``zstd_bomb``, ``msgpack_bomb``, ``huge_shape``, ``wrong_version`` (and magic, frame
type), ``oversize`` (a 64 MiB + 1 frame, chunk headers announcing too much),
``forged_sender`` (an honest id's topic with a wrong key; the rogue's topic naming an
honest sender), ``replay`` (captured honest frames, verbatim), ``unregistered``
(well-formed hellos, statuses and updates of ids without a key), ``chunk_flood``
(first chunks of transfers that never finish), ``forged_fleet`` (the coordinator's
status, ``starting`` and ``finished``, unsigned or signed with another key: refused by
every device, counted in the devices' logs), ``int_tensors`` (updates of the current
round under a compromised honest key, with int64 tensors of the model's names and
shapes), ``stale_offline`` (the devices' genuine ``offline`` statuses of the
reference run, replayed) and ``stale_task`` (the reference run's tasks, replayed to the
devices they named: refused by the devices, counted in their logs).

Counts per category: ``tried`` (publishes), ``rejected`` (refusal lines the coordinator
wrote while the burst was processed: lines saying refused / rejected / dropped /
ignored, at any level, except an honest device's own update sent again after a late
ack, which the coordinator answers as a duplicate; for the categories the devices
refuse, the lines the devices' logs gained during the burst), ``logged`` (those at
WARNING, what an operator sees at the default level). A burst the coordinator's exit cut
off before its fence counts nowhere. The refusal lines are what this benchmark
measures, so it reads them in the coordinator's log; the honest figures come from the
coordinator's status file (``STATE_DIR/status.json``) and are compared with an
abuse-free reference run of the same seed: rounds, honest updates on time, ``lost``
(expected minus on time), round durations, the coordinator's peak RSS, and whether the
final models are bit-identical.

Run::

    python -m benchmarks.abuse            # 4 devices, 200 rounds, bursts of 40
    python -m benchmarks.abuse --quick    # 2 devices, 40 rounds, bursts of 8 (1-3 min)
    python -m benchmarks.abuse --json     # the same figures as one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any, TextIO

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
    write_fleet,
)
from benchmarks.hostile import FENCE, FLEET, ROGUE, Hostile, envelope
from protocol.auth import Keyring
from protocol.chunking import read_chunk_header
from protocol.codec import FRAME_CHUNK, FRAME_MAGIC
from protocol.errors import DecodeError

CATEGORIES = (
    "random_bytes",
    "truncated",
    "bit_flipped",
    "zstd_bomb",
    "msgpack_bomb",
    "huge_shape",
    "wrong_version",
    "oversize",
    "forged_sender",
    "replay",
    "unregistered",
    "chunk_flood",
    "forged_fleet",
    "int_tensors",
    "stale_offline",
    "stale_task",
)
DEVICE_SIDE: dict[str, tuple[str, Callable[[list[int]], int]]] = {
    "forged_fleet": (f"dropped a bad payload on fl/{FLEET}/coordinator/status", min),
    "stale_task": ("ignored task ", sum),
}
"""Categories the devices refuse: the refusal line each device's log holds, and how the
devices' new lines of a burst add up (a forged fleet-wide frame reaches, and is refused
by, every device: the fewest lines of any; a replayed task only the device it names: the
sum)."""
DEVICE_WAIT_S = 30.0
"""How long after its fence a device-side burst's refusal lines may take to appear."""
# the refusal lines of the coordinator's log (``-v``), the thing this benchmark counts
_REFUSAL = re.compile(
    r"^\S+ \S+ (WARNING|DEBUG) (?:coordinator|protocol)[\w.]*: "
    r"(?:refused|rejected|dropped|dropping|ignored) "
)
_FENCE = re.compile(r"rejected update of rogue-0 for round (\d+)")
_RETRY = re.compile(r"ignored update ([0-9a-f]{32}) of \S+ for round \d+: a duplicate")
_DROPPED = re.compile(r"(?:dropped|dropping) incomplete transfer ([0-9a-f]{32}) from ")


@dataclass(frozen=True)
class AbuseConfig:
    """One benchmark run."""

    devices: int = 4
    """Honest edge-client processes."""
    rounds: int = 200
    """Rounds of the federated run."""
    burst: int = 40
    """Messages per burst of one category."""
    seed: int = 0
    """Seed of the run and of the hostile client's choices."""
    oversize_frames: int = 1
    """Frames of 64 MiB + 1 sent (each costs the broker and the coordinator a copy)."""
    timeout_s: float = 900.0
    """Give up on a run after this long."""


@dataclass
class Category:
    tried: int = 0
    """Messages published."""
    rejected: int = 0
    """Refusal lines the coordinator wrote for them (any level)."""
    logged: int = 0
    """Those of them at WARNING."""
    nacks: int = 0
    """Acknowledgements (accepted = false) the coordinator sent to honest devices meanwhile."""


@dataclass
class AbuseReport:
    """What one benchmark run measured."""

    devices: int
    rounds: int
    seed: int
    categories: dict[str, Category] = field(default_factory=dict)
    tried: int = 0
    rejected: int = 0
    logged: int = 0
    honest_transfers_dropped: int = 0
    """Lines saying the coordinator dropped an unfinished transfer the hostile client did
    not start (an honest device's upload evicted by a flood on its topic)."""
    honest_retries: int = 0
    """Honest devices' own updates sent again (an ack late under load) that the
    coordinator answered as duplicates while a burst was processed: not refusals."""
    held_at_end: int = 0
    """Unfinished transfers still buffered when the run ended (at most 4 per topic; the
    coordinator drops them after 120 s): tried but neither completed nor refused yet."""
    rounds_completed: int = 0
    reference_rounds_completed: int = 0
    honest_expected: int = 0
    honest_accepted: int = 0
    lost: int = 0
    """Honest updates expected (devices x rounds) that were not aggregated on time."""
    round_s_median: float = 0.0
    reference_round_s_median: float = 0.0
    round_s_max: float = 0.0
    reference_round_s_max: float = 0.0
    delay_s_median: float = 0.0
    """Median over rounds of (round duration under abuse - reference duration)."""
    coordinator_exit: int | None = None
    coordinator_peak_rss_mb: float | None = None
    reference_peak_rss_mb: float | None = None
    identical_to_reference: bool = False
    wall_s: float = 0.0
    reference_wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)


# -- fleet and processes -------------------------------------------------------------------


def start_coordinator(url: str, cfg: AbuseConfig, state: Path, keys: Path, log: Path) -> Any:
    command = coordinator_command(
        url, FLEET, rounds=cfg.rounds, min_devices=cfg.devices, state=state, keys=keys,
        extra=[*MLP_FEDAVG, "--seed", str(cfg.seed), "-v"],
    )  # fmt: skip
    return spawn(command, log)


# -- the run -------------------------------------------------------------------------------


def _kind(payload: bytes) -> str:
    """What a published payload was, for the journal: chunk, a message kind, or bytes."""
    if payload[:2] != FRAME_MAGIC or len(payload) < 4:
        return "bytes"
    if payload[3] == FRAME_CHUNK:
        return "chunk"
    env = envelope(payload)
    return str(env.get("kind")) if env is not None else "frame"


class LogReader:
    """Reads the coordinator's log as it grows and counts its refusal lines between
    fences (a fence is an update of the rogue id for round ``FENCE + k``, refused with a
    line naming that round, processed after everything published before it)."""

    def __init__(self, log: Path, honest_update: Callable[[str], bool]) -> None:
        self._log = log
        self._honest_update = honest_update
        self.honest_retries = 0
        """Duplicate lines about an honest device's own update (its retry after an ack
        it did not get in time, as under load): not refusals, so not counted."""
        self._offset = 0
        self._partial = b""
        self.dropped: dict[str, bool] = {}
        """Unfinished transfers the coordinator dropped: id (hex) -> logged at WARNING."""

    def skip(self) -> None:
        """Start reading at the log's current end."""
        self._offset, self._partial = self._log.stat().st_size, b""

    def until_fence(self, k: int, server: Any, timeout: float = 60.0) -> tuple[int, int, bool]:
        """(refusal lines, of them at WARNING, fence seen) up to fence ``k``."""
        total = warned = 0
        deadline = time.monotonic() + timeout
        while True:
            with self._log.open("rb") as f:
                f.seek(self._offset)
                data = self._partial + f.read()
            self._offset += len(data) - len(self._partial)
            *lines, self._partial = data.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace")
                fence = _FENCE.search(line)
                if fence is not None and int(fence.group(1)) == FENCE + k:
                    rest = b"\n".join(lines[lines.index(raw) + 1 :])
                    self._partial = rest + (b"\n" if rest else b"") + self._partial
                    return total, warned, True
                if fence is not None:
                    continue  # an earlier fence, seen late: not a refusal of this burst
                retry = _RETRY.search(line)
                if retry is not None and self._honest_update(retry.group(1)):
                    self.honest_retries += 1
                    continue
                dropped = _DROPPED.search(line)
                if dropped is not None:
                    tid = dropped.group(1)
                    self.dropped[tid] = self.dropped.get(tid, False) or " WARNING " in line
                    continue
                m = _REFUSAL.match(line)
                if m is not None:
                    total += 1
                    warned += m.group(1) == "WARNING"
            if server.poll() is not None or time.monotonic() >= deadline:
                return total, warned, False
            time.sleep(0.05)


def _attack(
    hostile: Hostile,
    cfg: AbuseConfig,
    reader: LogReader,
    server: Any,
    old: list[tuple[str, bytes]],
    report: AbuseReport,
    devices: DeviceLogs,
    journal: TextIO | None = None,
) -> None:
    """Bursts of one category at a time, each closed by a fence, until the coordinator
    exits; unfinished transfers dropped later are credited to the category that started
    them. A burst whose fence the coordinator did not log before it exited counts
    nowhere (neither tried nor rejected). A burst the devices refuse is counted in the
    lines their logs gained from before it until they hold one per message (or
    :data:`DEVICE_WAIT_S` passed)."""
    deadline = time.monotonic() + 120
    while not hostile.ready() and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    reader.skip()  # what came before the attack is not its doing
    rng, big_sent, k = hostile.rng, 0, 0
    started: dict[str, str] = {}  # transfer id (hex) -> category that started it
    mine: set[str] = set()  # every transfer id the hostile client started
    try:
        while server.poll() is None:
            order = list(CATEGORIES)
            rng.shuffle(order)
            for category in order:
                if server.poll() is not None:
                    return
                messages = hostile.burst(category, cfg.burst, old)
                if category == "oversize" and big_sent < cfg.oversize_frames:
                    messages.append(hostile.oversize_frame())
                    big_sent += 1
                nacks_before = len(hostile.nacks)
                device_side = DEVICE_SIDE.get(category)
                before = devices.refusals(device_side[0]) if device_side else None
                sent, transfers = 0, []
                for topic, payload in messages:
                    try:
                        hostile.publish(topic, payload)
                    except Exception as exc:  # a topic the broker refused: not tried
                        report.problems.append(f"{category}: not published on {topic!r}: {exc}")
                        continue
                    sent += 1
                    try:
                        transfers.append(read_chunk_header(payload).transfer_id.hex())
                    except DecodeError:
                        continue  # not a well-formed chunk: starts no transfer
                    mine.add(transfers[-1])
                k += 1
                hostile.publish(*hostile.fence(k))
                total, warned, seen = reader.until_fence(k, server)
                if not seen:
                    if server.poll() is None:
                        report.problems.append(f"fence {k} ({category}) not seen in the log")
                    return  # the run ended meanwhile: this burst did not meet a coordinator
                if device_side is not None and before is not None:
                    total, warned = devices.wait_for(device_side, before, sent)
                for tid in transfers:
                    started.setdefault(tid, category)
                if journal is not None:
                    kinds = [_kind(payload) for _, payload in messages]
                    record = {"fence": k, "category": category, "tried": sent}
                    record |= {"rejected": total, "kinds": kinds}
                    journal.write(json.dumps(record) + "\n")
                    journal.flush()
                entry = report.categories.setdefault(category, Category())
                entry.tried += sent
                entry.rejected += total
                entry.logged += warned
                entry.nacks += len(hostile.nacks) - nacks_before
    finally:
        reader.until_fence(-1, server, timeout=0.0)  # the rest of the log
        report.honest_retries = reader.honest_retries
        for tid, warned in reader.dropped.items():
            owner = started.get(tid)
            if owner is None:
                report.honest_transfers_dropped += tid not in mine
            else:
                report.categories[owner].rejected += 1
                report.categories[owner].logged += warned


def one_run(
    url: str, cfg: AbuseConfig, files: list[Path], keys: Path, work: Path, *,
    abuse: bool, old: list[tuple[str, bytes]], old_tasks: list[tuple[str, bytes]],
) -> tuple[AbuseReport, dict[int, tuple[float, int]], Hostile]:  # fmt: skip
    """One run from scratch; with ``abuse`` the hostile client attacks it (without, it
    only listens, recording frames to replay later). Returns its report, round -> (duration
    s, updates on time) from the status file, and the hostile client."""
    work.mkdir(parents=True)
    report = AbuseReport(devices=cfg.devices, rounds=cfg.rounds, seed=cfg.seed)
    honest = [f.stem for f in files]
    rogue_key = Keyring.load(keys)[ROGUE]
    stolen = Keyring.load(keys).without({ROGUE})  # the honest devices' keys, compromised
    hostile = Hostile(url, honest, rogue_key, cfg.seed, f"hostile-{work.name}", stolen)
    hostile.earlier_tasks = old_tasks
    hostile.start()
    log = work / "coordinator.log"
    start = time.monotonic()
    try:
        with ExitStack() as stack:
            started = stack.enter_context(processes())
            started.extend(
                start_devices(url, files, work / "devices", cfg.seed, fleet=FLEET, verbose=True)
            )
            server = start_coordinator(url, cfg, work / "state", keys, log)
            started.append(server)
            attacker = None
            if abuse:
                reader = LogReader(log, hostile.honest_update)
                journal = stack.enter_context((work / "bursts.jsonl").open("w"))
                logs = DeviceLogs(work / "devices", honest)
                attacker = threading.Thread(
                    target=_attack,
                    args=(hostile, cfg, reader, server, old, report, logs, journal),
                    daemon=True,
                )
                attacker.start()
            try:
                server.wait(cfg.timeout_s)
            except subprocess.TimeoutExpired:
                report.problems.append("the coordinator did not finish in time")
            if attacker is not None:
                attacker.join(60)
            report.coordinator_exit = server.poll()
            for device in started[: cfg.devices]:
                try:
                    device.wait(30)
                except subprocess.TimeoutExpired:
                    report.problems.append(f"device pid {device.pid} did not exit")
    finally:
        hostile.stop()
    report.wall_s = time.monotonic() - start
    if report.coordinator_exit != 0:
        report.problems.append(f"the coordinator ended with {report.coordinator_exit}")
    status = Status.read(work / "state")
    closed = {} if status is None else status.closed
    report.coordinator_peak_rss_mb = None if status is None else status.peak_rss_mb
    return report, {r: (c.duration_s, c.on_time) for r, c in closed.items()}, hostile


def run_benchmark(cfg: AbuseConfig, work: Path) -> AbuseReport:
    """Reference run (the hostile client only listens), then the same run under abuse."""
    files, keys = write_fleet(work / "fleet", cfg.devices, cfg.seed, key_only=(ROGUE,))
    with private_broker(work, "abuse") as broker:
        reference, ref_rounds, listener = one_run(
            broker.url, cfg, files, keys, work / "reference", abuse=False, old=[], old_tasks=[]
        )
        if reference.coordinator_exit != 0:
            raise RuntimeError(f"the reference run failed: {reference.problems}")
        report, rounds, _ = one_run(
            broker.url,
            cfg,
            files,
            keys,
            work / "abuse",
            abuse=True,
            old=listener.frames(),
            old_tasks=listener.task_frames,
        )
    report.reference_rounds_completed = len(ref_rounds)
    report.rounds_completed = len(rounds)
    report.honest_expected = cfg.devices * cfg.rounds
    report.honest_accepted = sum(on_time for _, on_time in rounds.values())
    report.lost = report.honest_expected - report.honest_accepted
    durations = [d for d, _ in rounds.values()] or [0.0]
    ref_durations = [d for d, _ in ref_rounds.values()] or [0.0]
    report.round_s_median = statistics.median(durations)
    report.round_s_max = max(durations)
    report.reference_round_s_median = statistics.median(ref_durations)
    report.reference_round_s_max = max(ref_durations)
    deltas = [rounds[r][0] - ref_rounds[r][0] for r in rounds if r in ref_rounds]
    report.delay_s_median = round(statistics.median(deltas), 3) if deltas else 0.0
    report.reference_peak_rss_mb = reference.coordinator_peak_rss_mb
    report.reference_wall_s = reference.wall_s
    report.held_at_end = _held_at_end(report)
    report.categories = {n: report.categories[n] for n in CATEGORIES if n in report.categories}
    for entry in report.categories.values():
        report.tried += entry.tried
        report.rejected += entry.rejected
        report.logged += entry.logged
    if report.coordinator_exit == 0:
        report.identical_to_reference = identical(
            final_models(work / "abuse" / "state"), final_models(work / "reference" / "state")
        )
    return report


class DeviceLogs:
    """The honest devices' logs (``root/{device}.log``), read for the refusal lines of the
    categories the devices refuse. Lines that no honest frame causes: an honest status
    never fails its signature, an honest task is never older than the newest taken. The
    devices run with ``-v``: a refusal of a kind logged at WARNING in the last minute is
    at DEBUG, so every refusal leaves a line."""

    def __init__(self, root: Path, devices: list[str]) -> None:
        self.root = root
        self.devices = devices

    def refusals(self, needle: str) -> tuple[list[int], list[int]]:
        """Per device, its lines holding ``needle``: all of them and those at WARNING."""
        counts, warned = [], []
        for device in self.devices:
            try:
                text = (self.root / f"{device}.log").read_text(errors="replace")
            except OSError:
                text = ""
            lines = [line for line in text.splitlines() if needle in line]
            counts.append(len(lines))
            warned.append(sum(" WARNING " in line for line in lines))
        return counts, warned

    def wait_for(
        self,
        side: tuple[str, Callable[[list[int]], int]],
        before: tuple[list[int], list[int]],
        sent: int,
        timeout_s: float = DEVICE_WAIT_S,
    ) -> tuple[int, int]:
        """The refusal lines (all, at WARNING) the devices wrote since ``before``, as
        ``side`` adds them up, once they reach ``sent`` or ``timeout_s`` passed."""
        needle, combine = side
        deadline = time.monotonic() + timeout_s
        while True:
            counts, warned = self.refusals(needle)
            total = combine([a - b for a, b in zip(counts, before[0], strict=True)])
            if total >= sent or time.monotonic() >= deadline:
                return total, combine([a - b for a, b in zip(warned, before[1], strict=True)])
            time.sleep(0.1)


def _held_at_end(report: AbuseReport) -> int:
    flood = report.categories.get("chunk_flood")
    return 0 if flood is None else max(0, flood.tried - flood.rejected)


# -- output --------------------------------------------------------------------------------


def markdown(report: AbuseReport) -> str:
    lines = ["| category | tried | rejected | logged (WARNING) | nacks to honest devices |"]
    lines.append("|---|---|---|---|---|")
    for name in CATEGORIES:
        c = report.categories.get(name, Category())
        lines.append(f"| {name} | {c.tried} | {c.rejected} | {c.logged} | {c.nacks} |")
    lines.append(f"| **all** | {report.tried} | {report.rejected} | {report.logged} | |")
    lines += ["", "| figure | abuse | reference |", "|---|---|---|"]
    pairs = [
        ("rounds completed", report.rounds_completed, report.reference_rounds_completed),
        ("honest updates on time", f"{report.honest_accepted}/{report.honest_expected}", ""),
        ("lost", report.lost, ""),
        ("round s (median)", report.round_s_median, report.reference_round_s_median),
        ("round s (max)", report.round_s_max, report.reference_round_s_max),
        ("delay s (median per round)", report.delay_s_median, ""),
        ("coordinator peak RSS MB", report.coordinator_peak_rss_mb,
         report.reference_peak_rss_mb),
        ("coordinator exit", report.coordinator_exit, 0),
        ("final models bit-identical", report.identical_to_reference, ""),
        ("unfinished transfers held at end", report.held_at_end, ""),
        ("honest updates sent again (answered as duplicates)", report.honest_retries, ""),
        ("wall s", report.wall_s, report.reference_wall_s),
    ]  # fmt: skip
    for name, a, b in pairs:
        fa = f"{a:.2f}" if isinstance(a, float) else a
        fb = f"{b:.2f}" if isinstance(b, float) else b
        lines.append(f"| {name} | {fa} | {fb} |")
    if report.problems:
        lines.append(f"\nproblems: {'; '.join(report.problems[:10])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="2 devices, 40 rounds, bursts of 8")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--devices", type=int, help="honest edge clients (default 4; --quick 2)")
    p.add_argument("--rounds", type=int, help="rounds (default 200; --quick 40)")
    p.add_argument("--burst", type=int, help="messages per burst (default 40; --quick 8)")
    p.add_argument("--seed", type=int, default=0, help="default 0")
    p.add_argument("--work-dir", type=Path, help="keep the files here (default: a temp dir)")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    cfg = AbuseConfig(
        devices=args.devices or (2 if args.quick else 4),
        rounds=args.rounds or (40 if args.quick else 200),
        burst=args.burst or (8 if args.quick else 40),
        seed=args.seed,
    )
    with ExitStack() as stack:
        work = args.work_dir or Path(stack.enter_context(TemporaryDirectory(prefix="abuse-")))
        report = run_benchmark(cfg, work)
    print(json.dumps(asdict(report), indent=2) if args.json else markdown(report))
    ok = (
        report.coordinator_exit == 0
        and report.identical_to_reference
        and report.lost == 0
        and all(c.tried > 0 for c in report.categories.values())
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
