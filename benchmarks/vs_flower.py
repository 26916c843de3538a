"""This sim against Flower's simulation: the same FedAvg workload, side by side, in one run.

The workload (issue 15): 50 LeNet-5 clients of 300 training samples each (MNIST-shaped,
1x28x28, 10 classes), 1 local epoch of batch 32, SGD lr 0.01 momentum 0.9, 3 FedAvg
rounds with every client in every round. It runs through

- ``python -m sim`` (a subprocess; the whole thing: interpreter start, data, the
  coordinator and 50 edge clients, the codec and, with ``--transport mqtt``, the
  embedded amqtt broker), once per ``--transports`` entry (mqtt and inproc by default),
  extra flags from ``--sim-args``;
- Flower's simulation engine (``flwr.simulation.run_simulation``, Ray backend) running
  ``benchmarks/external/flower_workload.py`` with the python of a separate virtual
  environment, ``.bench-venvs/flower/`` (gitignored; built on demand: a CPU torch first,
  then ``flwr[simulation]``). Flower is never a dependency of the project.

Both sides train on the same samples: this script writes one MNIST-format folder of
exactly 50 x 375 training images (300 train + 75 local test per device with the sim's
80/20 split; IID) and the 10,000-image test split, reads it through the sim's own
partitioner, and hands Flower the very same partitions as ``.npy`` files. With
``--data-dir`` the images are a seeded subsample of real MNIST; without it they come from
the sim's synthetic generator (no files needed). Both sides evaluate the global model
after each round on every device's test split and on the test split.

Measured per side: seconds end to end (process start to exit), seconds per warm round
(the mean of rounds 2.., dispatch to aggregation, evaluation excluded; from the sim's
``--json-out`` report and from a timing FedAvg subclass on Flower's side), client updates
per second (clients x rounds / end-to-end seconds) and the peak memory of the whole
process tree (:mod:`benchmarks.process_tree`; every descendant process, Ray's included:
the sum of their RSS sampled every 0.1 s from ``/proc``; the sum of their PSS, which
counts shared pages once, every 5 s, so a coarser figure). Also the CPU the rest of the machine used meanwhile ("others'
CPU", in cores): timings taken beside other work are slower, on both sides. Issue 15's
target: this sim >= 3x Flower's client updates per second at <= 1/3 of its peak memory.
The sides run one after the other, ``--repeat`` times, interleaved; the median is kept.

How to run (from the repository root; it takes a few minutes, and the first run builds
the Flower venv, about 1 GB, which takes a few more)::

    python -m benchmarks.vs_flower --setup                  # only build the Flower venv
    python -m benchmarks.vs_flower --data-dir ../shared/data/mnist --json-out vs.json
    python -m benchmarks.vs_flower --transports inproc --sim-args "--engine batched"

Progress goes to stderr; the table to stdout; each subprocess's output to
``--work-dir`` (a temporary folder unless given).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.process_tree import Measured, TreeTimeoutError, mb, run_measured
from models.datafiles import find_file, read_idx_images, read_idx_labels
from models.errors import DataFileError
from sim.run import SimConfig, build_federation
from sim.synthetic import make_synthetic

ROOT = Path(__file__).resolve().parents[1]

FLOWER_VENV = ROOT / ".bench-venvs" / "flower"
"""Flower's own virtual environment (gitignored), built by :func:`ensure_flower_venv`."""
FLOWER_REQUIREMENT = "flwr[simulation]>=1.41,<2"
"""Tested with flwr 1.41.0 (Ray 2.55.1); the simulation extra brings Ray."""
TORCH_REQUIREMENT = "torch==2.13.0"
"""Installed first, on its own, so that pip takes the CPU build where one is configured
(the project's README does the same) instead of several GB of CUDA packages."""
WORKLOAD_SCRIPT = ROOT / "benchmarks" / "external" / "flower_workload.py"
TEST_SAMPLES = 10_000
"""The global test split both sides evaluate on after each round (MNIST's t10k size)."""
TARGET_SPEEDUP = 3.0
TARGET_MEMORY = 1 / 3


class BenchError(Exception):
    """A step of the benchmark failed; the message says which and why."""


def progress(message: str) -> None:
    print(f"[vs_flower {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------ workload


@dataclass(frozen=True)
class Workload:
    clients: int = 50
    train_per_client: int = 300
    test_fraction: float = 0.2
    rounds: int = 3
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    seed: int = 0

    def samples_per_client(self) -> int:
        """Samples (train + local test) a client needs so that the sim's split, which
        keeps ``round(test_fraction * n)`` for test, leaves ``train_per_client``."""
        n = self.train_per_client
        while n - round(self.test_fraction * n) < self.train_per_client:
            n += 1
        return n

    @property
    def updates(self) -> int:
        return self.clients * self.rounds


# ---------------------------------------------------------------------------- data


def _write_idx(folder: Path, stem: str, images: np.ndarray, labels: np.ndarray) -> None:
    n, side = len(images), images.shape[-1]
    pixels = np.ascontiguousarray(images.reshape(n, side, side), dtype=np.uint8)
    with (folder / f"{stem}-images-idx3-ubyte").open("wb") as f:
        f.write(struct.pack(">iiii", 2051, n, side, side))
        f.write(pixels.tobytes())
    with (folder / f"{stem}-labels-idx1-ubyte").open("wb") as f:
        f.write(struct.pack(">ii", 2049, n))
        f.write(np.ascontiguousarray(labels, dtype=np.uint8).tobytes())


def _find_mnist(data_dir: Path, base: str) -> Path:
    try:
        return find_file("mnist", data_dir, base)
    except DataFileError as exc:
        raise BenchError(f"--data-dir {data_dir}: {exc}") from exc


def write_dataset(folder: Path, workload: Workload, data_dir: Path | None) -> str:
    """An MNIST-format folder with exactly clients x samples_per_client training images
    (uncompressed IDX); returns a description of where they came from."""
    folder.mkdir(parents=True, exist_ok=True)
    train_n = workload.clients * workload.samples_per_client()
    if data_dir is None:
        splits = make_synthetic(workload.seed, train_samples=train_n, test_samples=TEST_SAMPLES)
        if splits.test is None:
            raise BenchError("the synthetic generator made no test split")
        _write_idx(folder, "train", np.rint(splits.train.x * 255), splits.train.y)
        _write_idx(folder, "t10k", np.rint(splits.test.x * 255), splits.test.y)
        return f"synthetic (sim.synthetic, seed {workload.seed})"
    rng = np.random.default_rng([workload.seed, 15])
    for stem, n in (("train", train_n), ("t10k", TEST_SAMPLES)):
        images = read_idx_images(_find_mnist(data_dir, f"{stem}-images-idx3-ubyte"))
        labels = read_idx_labels(_find_mnist(data_dir, f"{stem}-labels-idx1-ubyte"))
        if len(images) < n:
            raise BenchError(f"{data_dir}: {stem} has {len(images)} images, {n} needed")
        keep = np.sort(rng.choice(len(images), size=n, replace=False))
        _write_idx(folder, stem, images[keep], labels[keep])
    return f"MNIST from {data_dir} (a seeded subsample: {train_n} train, {TEST_SAMPLES} test)"


def data_flags(data: Path, workload: Workload) -> list[str]:
    """The sim's data flags for the folder of :func:`write_dataset`."""
    return [
        "--dataset",
        "mnist",
        "--data-dir",
        str(data),
        "--alpha",
        "inf",
        "--test-fraction",
        str(workload.test_fraction),
    ]


def export_partitions(data: Path, out: Path, workload: Workload) -> dict[str, int]:
    """The sim's own partition of ``data`` as ``.npy`` files for Flower's side (see
    ``flower_workload.py``); returns the smallest and largest train split."""
    config = SimConfig(
        devices=workload.clients,
        dataset="mnist",
        data_dir=data,
        alpha=math.inf,
        test_fraction=workload.test_fraction,
        seed=workload.seed,
    )
    federation, _ = build_federation(config)
    out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "devtest"):
        parts = [d.train if split == "train" else d.test for d in federation.devices]
        np.save(out / f"{split}_x.npy", np.concatenate([p.x for p in parts]))
        np.save(out / f"{split}_y.npy", np.concatenate([p.y for p in parts]))
        np.save(out / f"{split}_offsets.npy", np.cumsum([0] + [len(p.y) for p in parts]))
    train_sizes = [len(d.train.y) for d in federation.devices]
    if federation.test is None:
        raise BenchError("the partition has no global test split")
    np.save(out / "test_x.npy", federation.test.x)
    np.save(out / "test_y.npy", federation.test.y)
    return {"min": min(train_sizes), "max": max(train_sizes)}


# ----------------------------------------------------------------------- the sides


@dataclass
class SideResult:
    system: str
    transport: str
    seconds_end_to_end: float
    seconds_per_warm_round: float
    round_wall_s: list[float]
    client_updates_per_s: float
    peak_tree_rss_bytes: int
    peak_tree_pss_bytes: int
    peak_processes: int
    leftover_processes: int
    other_cpu_cores: float
    final_amp: float | None
    final_global_acc: float | None
    versions: dict[str, str]
    command: str
    runs: int = 1
    per_run: list[dict[str, float]] = field(default_factory=list)
    vs_flower: dict[str, float] = field(default_factory=dict)


def _warm(walls: list[float]) -> float:
    return statistics.fmean(walls[1:] or walls)


def _check(label: str, measured: Measured) -> None:
    if measured.returncode != 0:
        tail = measured.log.read_text(errors="replace")[-4000:]
        raise BenchError(
            f"{label} exited {measured.returncode}; the end of {measured.log}:\n{tail}"
        )


def run_sim(
    transport: str,
    workload: Workload,
    data: Path,
    extra: list[str],
    work: Path,
    env: dict[str, str],
    timeout: float,
    tag: str,
) -> SideResult:
    report = work / f"sim-{transport}-{tag}.json"
    command = [
        sys.executable,
        "-m",
        "sim",
        "--devices",
        str(workload.clients),
        "--rounds",
        str(workload.rounds),
        "--participation",
        "1.0",
        "--strategy",
        "fedavg",
        "--model",
        "lenet5",
        *_training_flags(workload),
        *data_flags(data, workload),
        "--transport",
        transport,
        "--json-out",
        str(report),
        *extra,
    ]
    label = f"sim ({transport})"
    log = work / f"sim-{transport}-{tag}.log"
    measured = run_measured(label, command, log, env, timeout, cwd=ROOT, progress=progress)
    _check(label, measured)
    data_out = json.loads(report.read_text())
    walls = [float(r["wall_s"]) for r in data_out["rounds"]]
    if len(walls) != workload.rounds:
        raise BenchError(f"{label}: {len(walls)} of {workload.rounds} rounds in {report}")
    final = data_out["rounds"][-1]["models"].get("aca", {})
    return _result("edgefl sim", transport, measured, walls, final, workload, {}, command)


def _training_flags(workload: Workload) -> list[str]:
    """The local-training flags both sides take with the same names."""
    return [
        "--local-epochs",
        str(workload.local_epochs),
        "--batch-size",
        str(workload.batch_size),
        "--lr",
        str(workload.lr),
        "--momentum",
        str(workload.momentum),
        "--seed",
        str(workload.seed),
    ]


def run_flower(
    python: Path,
    workload: Workload,
    partitions: Path,
    work: Path,
    env: dict[str, str],
    timeout: float,
    cpus_per_client: float,
    tag: str,
) -> SideResult:
    report = work / f"flower-{tag}.json"
    command = [
        str(python),
        str(WORKLOAD_SCRIPT),
        "--data",
        str(partitions),
        "--rounds",
        str(workload.rounds),
        *_training_flags(workload),
        "--cpus-per-client",
        str(cpus_per_client),
        "--json-out",
        str(report),
    ]
    log = work / f"flower-{tag}.log"
    measured = run_measured("flower", command, log, env, timeout, cwd=ROOT, progress=progress)
    _check("flower", measured)
    data_out = json.loads(report.read_text())
    walls = [float(r["wall_s"]) for r in data_out["rounds"]]
    final = data_out["evaluations"][-1] if data_out["evaluations"] else {}
    versions = data_out["versions"]
    return _result("flower", "ray", measured, walls, final, workload, versions, command)


def _result(
    system: str,
    transport: str,
    measured: Measured,
    walls: list[float],
    final: dict[str, Any],
    workload: Workload,
    versions: dict[str, str],
    command: list[str],
) -> SideResult:
    return SideResult(
        system=system,
        transport=transport,
        seconds_end_to_end=measured.seconds,
        seconds_per_warm_round=_warm(walls),
        round_wall_s=walls,
        client_updates_per_s=workload.updates / measured.seconds,
        peak_tree_rss_bytes=measured.peak_rss,
        peak_tree_pss_bytes=measured.peak_pss,
        peak_processes=measured.peak_processes,
        leftover_processes=measured.leftover_processes,
        other_cpu_cores=measured.other_cpu_cores,
        final_amp=final.get("amp"),
        final_global_acc=final.get("global_acc"),
        versions=versions,
        command=shlex.join(command),
    )


def median_result(runs: list[SideResult], workload: Workload) -> SideResult:
    """One result for repeated runs: the median of every figure (first run's rest)."""
    first = runs[0]
    per_run = [
        {
            "seconds_end_to_end": r.seconds_end_to_end,
            "seconds_per_warm_round": r.seconds_per_warm_round,
            "peak_tree_rss_bytes": r.peak_tree_rss_bytes,
            "other_cpu_cores": r.other_cpu_cores,
        }
        for r in runs
    ]
    if len(runs) == 1:
        first.per_run = per_run
        return first
    seconds = statistics.median(r.seconds_end_to_end for r in runs)
    return SideResult(
        **{
            **asdict(first),
            "seconds_end_to_end": seconds,
            "seconds_per_warm_round": statistics.median(r.seconds_per_warm_round for r in runs),
            "client_updates_per_s": workload.updates / seconds,
            "peak_tree_rss_bytes": int(statistics.median(r.peak_tree_rss_bytes for r in runs)),
            "peak_tree_pss_bytes": int(statistics.median(r.peak_tree_pss_bytes for r in runs)),
            "peak_processes": max(r.peak_processes for r in runs),
            "other_cpu_cores": max(r.other_cpu_cores for r in runs),
            "runs": len(runs),
            "per_run": per_run,
        }
    )


# ----------------------------------------------------------------- the Flower venv


def _venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _spec(torch_requirement: str, flower_requirement: str) -> str:
    return f"{torch_requirement}\n{flower_requirement}\n"


def _flower_ready(python: Path) -> bool:
    check = "import flwr, ray, torch; from flwr.simulation import run_simulation"
    if not python.exists():
        return False
    done = subprocess.run([str(python), "-c", check], capture_output=True, text=True)
    return done.returncode == 0


def ensure_flower_venv(
    venv: Path, torch_requirement: str, flower_requirement: str, rebuild: bool = False
) -> Path:
    """Build (or reuse) Flower's venv; returns its python. A venv built with other
    requirements, or one that cannot import Flower, is rebuilt.

    Raises:
        BenchError: the venv or a pip install failed (pip's output in the message).
    """
    python = _venv_python(venv)
    marker = venv / "edgefl-bench-requirements.txt"
    spec = _spec(torch_requirement, flower_requirement)
    fresh = marker.exists() and marker.read_text() == spec
    if not rebuild and fresh and _flower_ready(python):
        return python
    if venv.exists():
        progress(f"removing the stale Flower venv {venv}")
        shutil.rmtree(venv)
    progress(f"building Flower's venv in {venv} (once; a few minutes, about 1 GB)")
    _step(
        [sys.executable, "-m", "venv", str(venv)],
        f"python -m venv {venv}",
    )
    for requirement in (torch_requirement, flower_requirement):
        progress(f"pip install {requirement}")
        _step(
            [str(python), "-m", "pip", "install", "--disable-pip-version-check", requirement],
            f"pip install {requirement!r} into {venv}",
        )
    if not _flower_ready(python):
        raise BenchError(f"{venv}: installed, but 'import flwr, ray, torch' fails")
    marker.write_text(spec)
    progress(f"Flower's venv is ready: {python}")
    return python


def _step(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()
        raise BenchError(f"{what} failed (exit {done.returncode}); it said:\n{output}")


def flower_env() -> dict[str, str]:
    """The environment of Flower's run: no project venv or PYTHONPATH leaking in, and
    no usage reporting (the machines may have no network; the sim reports nothing)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["FLWR_TELEMETRY_ENABLED"] = "0"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


# --------------------------------------------------------------------------- output


def add_ratios(ours: list[SideResult], flower: SideResult) -> None:
    for result in ours:
        speed = result.client_updates_per_s / flower.client_updates_per_s
        memory = result.peak_tree_rss_bytes / flower.peak_tree_rss_bytes
        result.vs_flower = {
            "client_updates_per_s_ratio": speed,
            "peak_tree_rss_ratio": memory,
            "peak_tree_pss_ratio": (
                result.peak_tree_pss_bytes / flower.peak_tree_pss_bytes
                if flower.peak_tree_pss_bytes
                else math.nan
            ),
            "seconds_per_warm_round_ratio": (
                flower.seconds_per_warm_round / result.seconds_per_warm_round
            ),
            "meets_target": float(speed >= TARGET_SPEEDUP and memory <= TARGET_MEMORY),
        }


def table(results: list[SideResult]) -> str:
    head = (
        "| system | transport | end to end | s / warm round | updates / s | peak tree RSS "
        "| peak tree PSS | processes | others' CPU | AMP | vs Flower: speed, memory |"
    )
    rows = [head, "|" + " --- |" * 11]
    for r in results:
        amp = "-" if r.final_amp is None else f"{r.final_amp:.1f} %"
        ratio = (
            f"{r.vs_flower['client_updates_per_s_ratio']:.2f}x, "
            f"{r.vs_flower['peak_tree_rss_ratio']:.2f}x"
            if r.vs_flower
            else "-"
        )
        rows.append(
            f"| {r.system} | {r.transport} | {r.seconds_end_to_end:.1f} s "
            f"| {r.seconds_per_warm_round:.2f} s | {r.client_updates_per_s:.2f} "
            f"| {mb(r.peak_tree_rss_bytes)} | {mb(r.peak_tree_pss_bytes)} "
            f"| {r.peak_processes} | {r.other_cpu_cores:.2f} cores | {amp} | {ratio} |"
        )
    return "\n".join(rows)


def our_versions() -> dict[str, str]:
    import torch

    versions = {"torch": torch.__version__, "python": platform.python_version()}
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    if done.returncode == 0:
        versions["edgefl_commit"] = done.stdout.strip()
    return versions


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_bytes": memory,
        "platform": platform.platform(),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
    }


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="The issue-15 workload through python -m sim and through Flower's "
        "simulation, side by side: seconds end to end, seconds per warm round, peak memory "
        "of the whole process tree.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--setup", action="store_true", help="only build Flower's venv, then exit")
    parser.add_argument("--rebuild-venv", action="store_true", help="rebuild Flower's venv first")
    parser.add_argument("--venv", type=Path, default=FLOWER_VENV, help="Flower's venv")
    parser.add_argument(
        "--flower-requirement", default=FLOWER_REQUIREMENT, help="what pip installs as Flower"
    )
    parser.add_argument(
        "--torch-requirement",
        default=TORCH_REQUIREMENT,
        help="the torch pip installs into Flower's venv first (a CPU build where configured)",
    )
    parser.add_argument(
        "--data-dir", type=Path, help="MNIST's files (unset: the sim's synthetic generator)"
    )
    parser.add_argument(
        "--transports",
        nargs="+",
        choices=["mqtt", "inproc"],
        default=["mqtt", "inproc"],
        help="the sim's transports to measure, one run each",
    )
    parser.add_argument(
        "--sim-args",
        default="",
        help='extra flags for python -m sim, e.g. "--engine batched" (one flag alone: '
        "--sim-args=--flag)",
    )
    parser.add_argument("--skip-flower", action="store_true", help="measure this sim only")
    parser.add_argument(
        "--cpus-per-client",
        type=float,
        default=1.0,
        help="Flower's Ray client_resources num_cpus (1: one actor, one training per core)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="runs per side (median taken)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--clients", type=int, default=Workload.clients, help="clients (devices) K")
    parser.add_argument(
        "--train-per-client",
        type=int,
        default=Workload.train_per_client,
        help="training samples per client (plus the sim's 20 %% local test share)",
    )
    parser.add_argument(
        "--rounds", type=int, default=Workload.rounds, help="FedAvg rounds, all clients each"
    )
    parser.add_argument("--work-dir", type=Path, help="keep data, logs and reports here")
    parser.add_argument("--json-out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.clients < 1 or args.rounds < 1 or args.train_per_client < 1:
        parser.error("--repeat, --clients, --rounds and --train-per-client must be >= 1")
    return args


@contextlib.contextmanager
def _work_dir(path: Path | None) -> Iterator[Path]:
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="vs-flower-") as tmp:
        yield Path(tmp)


def run(args: argparse.Namespace) -> int:
    python = None
    if not args.skip_flower or args.setup:
        python = ensure_flower_venv(
            args.venv, args.torch_requirement, args.flower_requirement, args.rebuild_venv
        )
    if args.setup:
        return 0
    host = machine()
    workload = Workload(
        clients=args.clients, train_per_client=args.train_per_client, rounds=args.rounds
    )
    extra = shlex.split(args.sim_args)
    with _work_dir(args.work_dir) as work:
        progress(f"writing the dataset ({workload.clients} x {workload.samples_per_client()})")
        data = work / "data"
        source = write_dataset(data, workload, args.data_dir)
        partitions = work / "flower-data"
        sizes = export_partitions(data, partitions, workload)
        if sizes["min"] != workload.train_per_client or sizes["max"] != workload.train_per_client:
            raise BenchError(f"train samples per client {sizes}, not {workload.train_per_client}")
        # Repeats are interleaved (every side once, then again), so that a load the
        # machine picks up meanwhile falls on every side alike.
        runs: dict[str, list[SideResult]] = {t: [] for t in args.transports}
        if python is not None:
            runs["flower"] = []
        for i in range(args.repeat):
            if args.repeat > 1:
                progress(f"repeat {i + 1} of {args.repeat}")
            for transport in args.transports:
                result = run_sim(
                    transport, workload, data, extra, work, dict(os.environ), args.timeout, str(i)
                )
                progress(f"sim ({transport}): {result.seconds_end_to_end:.1f} s end to end")
                runs[transport].append(result)
            if python is not None:
                result = run_flower(
                    python,
                    workload,
                    partitions,
                    work,
                    flower_env(),
                    args.timeout,
                    args.cpus_per_client,
                    str(i),
                )
                progress(f"flower: {result.seconds_end_to_end:.1f} s end to end")
                runs["flower"].append(result)
        results = [median_result(runs[t], workload) for t in args.transports]
        for result in results:
            result.versions = our_versions()
        if python is not None:
            flower = median_result(runs["flower"], workload)
            add_ratios(results, flower)
            results.append(flower)
    print(
        f"{workload.clients} clients x {workload.train_per_client} train samples, "
        f"{workload.rounds} rounds, {workload.local_epochs} epoch of batch {workload.batch_size}"
        f"; data: {source}; sim args: {args.sim_args or '(none)'}"
    )
    print(table(results))
    print(
        f"target: this sim >= {TARGET_SPEEDUP:.0f}x Flower's updates/s at <= "
        f"1/{1 / TARGET_MEMORY:.0f} of its peak memory"
    )
    if args.json_out is not None:
        document = {
            "benchmark": "vs_flower",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": host,
            "workload": {**asdict(workload), "data": source, "sim_args": args.sim_args},
            "target": {"speedup": TARGET_SPEEDUP, "memory_ratio": TARGET_MEMORY},
            "results": [asdict(r) for r in results],
        }
        args.json_out.write_text(json.dumps(document, indent=2, allow_nan=True))
        progress(f"wrote {args.json_out}")
    return 0


def _interrupted(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM, and SIGINT even where a shell started us with it ignored, unwind through
    # run_measured, which kills the measured process tree.
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, _interrupted)
    try:
        return run(args)
    except (BenchError, TreeTimeoutError) as exc:
        print(f"vs_flower: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(
            f"vs_flower: interrupted ({exc}); the measured processes were killed", file=sys.stderr
        )
        return 130


if __name__ == "__main__":
    sys.exit(main())
