"""The benchmarks' process harness: a private Mosquitto, a keyed fleet on disk, the
coordinator and the edge clients as processes, the coordinator's status file, and every
process stopped on the way out.

The figures come from the coordinator's status file (``STATE_DIR/status.json``, written
by :class:`coordinator.runtime.RunStatus`; :class:`Status` reads it), never from its log
lines. :mod:`benchmarks.faults`, :mod:`benchmarks.fault_scenarios`,
:mod:`benchmarks.abuse`, :mod:`benchmarks.load` and
:mod:`benchmarks.coordinator_overhead` run on it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from coordinator.runtime import STATUS_FILE
from protocol.auth import Keyring, new_key, write_key_file
from protocol.signing import SigningKey
from sim.datasets import load_dataset
from sim.partition import partition_dataset, save_device_file

if TYPE_CHECKING:
    from tests.protocol.brokers import Mosquitto

__all__ = [
    "MLP_FEDAVG",
    "ROOT",
    "RoundClose",
    "Status",
    "coordinator_command",
    "edge_client_command",
    "final_models",
    "identical",
    "private_broker",
    "processes",
    "spawn",
    "start_devices",
    "stop",
    "wait_status",
    "write_fleet",
]

ROOT = Path(__file__).resolve().parents[1]
MLP_FEDAVG = (
    "--strategy", "fedavg", "--model", "mlp", "--local-steps", "2", "--batch-size", "16",
)  # fmt: skip
"""The small job of the fault and abuse runs: FedAvg on the MLP, 2 local steps of 16."""


# -- processes -----------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """This process's environment for a child that imports the checkout: the repository
    root first on ``PYTHONPATH``, what was there after it (packages installed with
    ``pip --target``, say)."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"}


def spawn(command: list[str], log: Path, *, one_thread: bool = True) -> subprocess.Popen[bytes]:
    """Start ``command`` in the repository root, its stdout and stderr appended to
    ``log``; with ``one_thread``, OpenMP gets one thread (``OMP_NUM_THREADS=1``)."""
    env = child_env()
    if one_thread:
        env["OMP_NUM_THREADS"] = "1"
    with log.open("ab") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen[Any]) -> None:
    """Kill ``process`` if it still runs and reap it (10 s at most)."""
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


@contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """A list of processes, every one killed on the way out."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for process in started:
            stop(process)


@contextmanager
def private_broker(work: Path, benchmark: str) -> Iterator[Mosquitto]:
    """A Mosquitto of its own (anonymous, no ACL) with its files in ``work/mosquitto``.

    Raises:
        SystemExit: the mosquitto binary is not installed.
    """
    from tests.protocol.brokers import Mosquitto, mosquitto_binary

    if mosquitto_binary() is None:
        raise SystemExit(f"{benchmark}: the mosquitto binary is not installed")
    (work / "mosquitto").mkdir(parents=True)
    with Mosquitto(work / "mosquitto") as broker:
        yield broker


# -- the fleet -----------------------------------------------------------------------------


def write_fleet(
    root: Path, devices: int, seed: int, *, key_only: Sequence[str] = ()
) -> tuple[list[Path], Path]:
    """Device data files (synthetic, IID), one key file each (``ID.key`` beside
    ``ID.npz``), the coordinator's signing key ``root/coordinator.key`` (and its ``.pub``)
    and keyring ``root/keys.json`` (holding a key for each
    id of ``key_only`` too: ids with no device behind them)."""
    root.mkdir(parents=True, exist_ok=True)
    federation = partition_dataset(
        load_dataset("synthetic", seed=seed), devices, float("inf"), seed=seed
    )
    paths, keys = [], {}
    for split in federation.devices:
        path = root / f"{split.device_id}.npz"
        save_device_file(path, split)
        keys[split.device_id] = new_key()
        write_key_file(path.with_suffix(".key"), keys[split.device_id])
        paths.append(path)
    keys |= {device_id: new_key() for device_id in key_only}
    Keyring(keys).save(root / "keys.json")
    SigningKey.generate().save(root / "coordinator.key")  # and coordinator.key.pub
    return paths, root / "keys.json"


def edge_client_command(
    url: str, fleet: str, data: Path, state: Path, extra: Sequence[str] = ()
) -> list[str]:
    """``python -m edge_client`` on ``data`` with its key file (``data`` with ``.key``)
    and state dir, leaving when the run finishes; ``extra`` flags appended."""
    return [
        sys.executable, "-m", "edge_client", "--broker", url, "--fleet", fleet,
        "--data", str(data), "--state-dir", str(state),
        "--auth-key-file", str(data.with_suffix(".key")),
        "--coordinator-key-file", str(data.parent / "coordinator.key.pub"),
        "--exit-when-finished", *extra,
    ]  # fmt: skip


def start_devices(
    url: str, files: list[Path], root: Path, seed: int, *, fleet: str, verbose: bool = False
) -> list[subprocess.Popen[bytes]]:
    """An MLP edge client per data file of ``files`` (initialised from ``seed``), each
    with its state dir and log under ``root`` (with ``verbose``, DEBUG lines too)."""
    root.mkdir(parents=True, exist_ok=True)
    started = []
    for path in files:
        extra = ("--model", "mlp", "--init-seed", str(seed), *(("-v",) if verbose else ()))
        command = edge_client_command(url, fleet, path, root / path.stem, extra)
        started.append(spawn(command, root / f"{path.stem}.log"))
    return started


def coordinator_command(
    url: str,
    fleet: str,
    *,
    rounds: int,
    min_devices: int,
    state: Path,
    keys: Path,
    participation: float = 1.0,
    round_timeout_s: float = 120,
    extra: Sequence[str] = (),
) -> list[str]:
    """``python -m coordinator`` for a keyed fleet with a state dir (whose status file
    :class:`Status` reads); ``extra`` flags appended (the strategy, model, seed ...)."""
    return [
        sys.executable, "-m", "coordinator", "--broker", url, "--fleet", fleet,
        "--rounds", str(rounds), "--participation", repr(participation),
        "--min-devices", str(min_devices), "--round-timeout", str(round_timeout_s),
        "--state-dir", str(state), "--device-keys", str(keys),
        "--signing-key-file", str(keys.parent / "coordinator.key"), *extra,
    ]  # fmt: skip


def final_models(state: Path) -> dict[str, Any]:
    """The final ACA model a coordinator saved under its state dir ``state``."""
    return dict(torch.load(state / "final" / "aca.pt", weights_only=True))


def identical(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two state dicts hold the same tensors, bit for bit."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the coordinator's status file ---------------------------------------------------------


@dataclass(frozen=True)
class RoundClose:
    """One round's close, as the coordinator recorded it."""

    duration_s: float
    """From the round's start (devices selected) to its close (aggregate stored)."""
    on_time: int
    """Updates aggregated: those accepted before the deadline."""
    selected: int
    late: int
    rejected: int
    server_step_s: float
    """The round's server step (aggregation, distillation ...), seconds."""


@dataclass(frozen=True)
class Status:
    """The coordinator's status file (``STATE_DIR/status.json``), read at one moment."""

    pid: int
    """The process that wrote it last."""
    phase: str
    """``starting``, ``training``, ``aggregating``, ``closed``, ``finished``, ``stopped``."""
    selected: dict[int, int]
    """Round -> devices selected, for every round started (by any process of the run)."""
    started_at: dict[int, float]
    """Round -> Unix time of its start."""
    closed: dict[int, RoundClose]
    """Round -> its last close (a round closed again after a crash: the later close)."""
    peak_rss_mb: float | None
    """The writing process's peak RSS, MB (2**20 bytes), once it has exited."""

    @classmethod
    def read(cls, state: Path) -> Status | None:
        """The status under the state dir ``state``; None before the coordinator wrote one."""
        try:
            raw = json.loads((state / STATUS_FILE).read_text())
        except FileNotFoundError:
            return None
        started = raw["started"].items()
        return cls(
            pid=int(raw["pid"]),
            phase=str(raw["phase"]),
            selected={int(r): int(s["selected"]) for r, s in started},
            started_at={int(r): float(s["at"]) for r, s in started},
            closed={int(r): RoundClose(**c) for r, c in raw["closed"].items()},
            peak_rss_mb=raw["peak_rss_mb"],
        )


def wait_status(
    state: Path,
    process: subprocess.Popen[bytes],
    ready: Callable[[Status], bool],
    timeout: float,
) -> Status | None:
    """The first status of ``process`` (written by it, not by an earlier coordinator of
    the same state dir) that is ``ready``; None if ``process`` ended or ``timeout`` s
    passed first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = Status.read(state)
        if status is not None and status.pid == process.pid and ready(status):
            return status
        if process.poll() is not None:
            return None
        time.sleep(0.05)
    return None
