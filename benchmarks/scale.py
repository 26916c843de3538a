"""Fleet scale benchmark: the whole sim end to end against the cohort engine alone.

For each fleet size (``--devices``, 1,000 and 10,000 by default) it runs, each in a
process of its own so that its peak memory is its own:

- ``sim``: ``python -m sim``'s run (:func:`sim.run.run_simulation`): one coordinator and
  N emulated LeNet-5 devices, all selected each round, FedAvg, one local epoch at batch
  32 on ``--samples`` MNIST-shaped synthetic samples each (IID; a fifth more make each
  device's local test split), the batched engine, every message encoded, signed, sent,
  verified and decoded; through the in-process broker (``inproc``) and, where the
  ``mosquitto`` binary is installed, a private Mosquitto (``mosquitto``, unpaced: its
  queue for the coordinator is unbounded);
- ``engine``: :func:`sim.cohort.engine.train_cohort` alone on the same cohort (N
  devices, the same model, samples and hyperparameters), timed by
  :func:`benchmarks.cohort.run_one`.

``e2e_updates_per_s`` counts the sim's updates over the warm rounds: N over the mean
time from one round's close to the next (the task fan-out, the training, the uploads,
and the aggregation: everything a round costs, the sim's evaluation of each round
included where it holds the next round up, as the evaluator's thread competes for the
same cores); the first round (the devices' trainers are built then) is reported apart as
``first_round_s``.
``ratio`` = e2e over engine updates per second; targets: 0.7 in process, 0.5 through
Mosquitto. ``device`` names the CPU model or GPU (:func:`benchmarks.cohort.device_name`).

The ``coordinator`` rows are :func:`benchmarks.coordinator_scale.coordinator_rows` at
``--coordinator-devices`` (1,000, 10,000 and 100,000 by default): the coordinator's
microseconds per update, fed pre-encoded, pre-signed updates.

Run: ``python -m benchmarks.scale [--devices 1000,10000] [--transports inproc,mosquitto]
[--rounds 2] [--samples 300] [--device auto|cpu|cuda] [--data-dir DIR] [--json PATH]``.
Output: ``{"sim": [{devices, model, transport, e2e_updates_per_s, engine_updates_per_s,
ratio, peak_rss_bytes, peak_gpu_bytes, device, ...}], "coordinator": [...]}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.coordinator_scale import coordinator_rows
from benchmarks.harness import child_env

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"inproc": 0.7, "mosquitto": 0.5}
"""The e2e / engine ratio each transport should reach at least."""
MODEL = "lenet5"
TEST_SHARE = 0.2
"""The local test share of each emulated device's samples (the sim's default)."""


def run_sim(options: dict[str, Any]) -> dict[str, Any]:
    """One sim run, measured in this process."""
    import torch

    from models.devices import resolve_device
    from sim.run import SimConfig, run_simulation
    from sim.run_cli import tune_process

    tune_process()  # as python -m sim does
    torch.set_num_threads(options["threads"])
    devices, samples = options["devices"], options["samples"]
    data: dict[str, Any] = {"dataset": "synthetic"}
    if options["data_dir"] is not None:
        data = {"dataset": "mnist", "data_dir": Path(options["data_dir"])}
    else:
        data["samples_per_device"] = math.ceil(samples / (1 - TEST_SHARE))
    config = SimConfig(
        devices=devices,
        participation=1.0,
        rounds=options["rounds"],
        model=MODEL,
        strategy="fedavg",
        training={"local_epochs": 1, "batch_size": 32},
        alpha=math.inf,
        test_fraction=TEST_SHARE,
        transport="mqtt" if options["broker_url"] else "inproc",
        broker_url=options["broker_url"],
        max_rate=0 if options["broker_url"] else None,
        engine="batched",
        device=options["device"],
        **data,
    )
    report = run_simulation(config)
    records = report.rounds
    if len(records) != options["rounds"]:
        raise RuntimeError(f"{len(records)} of {options['rounds']} rounds closed")
    if any(r.active_devices != devices for r in records):
        counts = [r.active_devices for r in records]
        raise RuntimeError(f"not every device's update was aggregated: {counts}")
    closes = [r.closed_s for r in records if r.closed_s is not None]
    cycles = [b - a for a, b in itertools.pairwise(closes)]
    warm = sum(cycles) / len(cycles) if cycles else records[0].wall_s
    device = resolve_device(options["device"])
    return {
        "devices": devices,
        "first_round_s": round(records[0].wall_s, 3),
        "warm_round_s": round(warm, 3),
        "warm_rounds": len(cycles),
        "e2e_updates_per_s": round(devices / warm, 2),
        "bytes_down_per_round": records[-1].bytes_down,
        "bytes_up_per_round": records[-1].bytes_up,
        "peak_rss_bytes": report.final["peak_rss_bytes"],
        "peak_gpu_bytes": report.final["peak_gpu_bytes"],
        "device": _device_name(device),
    }


def run_engine(options: dict[str, Any]) -> dict[str, Any]:
    """The cohort engine alone on the sim's cohort, measured in this process."""
    import torch

    from benchmarks.cohort import run_one

    torch.set_num_threads(options["threads"])
    return run_one(
        {
            "engine": "batched",
            "model": MODEL,
            "strategy": "fedavg",
            "devices": options["devices"],
            "device": options["device"],
            "samples": options["samples"],
            "loop_sample": options["devices"],
            "max_cohort": None,
            "data_dir": None if options["data_dir"] is None else Path(options["data_dir"]),
        }
    )


def _device_name(device: Any) -> str:
    from benchmarks.cohort import device_name

    return f"{device.type}: {device_name(device)}"


def _child(kind: str, options: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run one measurement in a fresh process; its row, or ``{"error": ...}``."""
    command = [sys.executable, "-m", "benchmarks.scale", "--one", json.dumps([kind, options])]
    env = child_env()
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-3:]
        return {"error": f"exit {done.returncode}: {' | '.join(tail)}"}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def measure(args: argparse.Namespace, broker_url: str | None) -> list[dict[str, Any]]:
    """The sim rows of every fleet size and transport (``broker_url`` None: no Mosquitto)."""
    transports = [t for t in args.transports.split(",") if t]
    rows = []
    for devices in (int(d) for d in args.devices.split(",")):
        options = {
            "devices": devices,
            "samples": args.samples,
            "rounds": args.rounds,
            "device": args.device,
            "threads": args.threads,
            "data_dir": None if args.data_dir is None else str(args.data_dir),
            "broker_url": None,
        }
        engine = _child("engine", options, args.timeout)
        for transport in transports:
            if transport == "mosquitto" and broker_url is None:
                print(f"{devices} devices via mosquitto: skipped (no mosquitto binary)")
                continue
            url = broker_url if transport == "mosquitto" else None
            sim = _child("sim", {**options, "broker_url": url}, args.timeout)
            row = {"devices": devices, "model": MODEL, "transport": transport, **sim}
            if "error" in engine:
                row["engine_error"] = engine["error"]
            else:
                row["engine_updates_per_s"] = engine["updates_per_s"]
                row["engine_peak_rss_bytes"] = engine["peak_rss_bytes"]
                row["engine_peak_gpu_bytes"] = engine["peak_gpu_bytes"]
                row.setdefault("device", engine["device"])
            if "e2e_updates_per_s" in row and "engine_updates_per_s" in row:
                row["ratio"] = round(row["e2e_updates_per_s"] / row["engine_updates_per_s"], 3)
            rows.append(row)
            print(line(row), flush=True)
    return rows


def line(row: dict[str, Any]) -> str:
    """One row as a line of text, with its target."""
    head = f"{row['devices']:>6} {row['model']} {row['transport']:9}"
    if "error" in row:
        return f"{head} sim failed: {row['error']}"
    text = (
        f"{head} e2e {row['e2e_updates_per_s']:9.1f} updates/s "
        f"(first round {row['first_round_s']:.1f} s, warm {row['warm_round_s']:.1f} s), "
        f"peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB"
    )
    if "ratio" in row:
        target = TARGETS[row["transport"]]
        verdict = "meets" if row["ratio"] >= target else "misses"
        text += (
            f"; engine {row['engine_updates_per_s']:.1f} updates/s; ratio {row['ratio']:.2f} "
            f"({verdict} the {target}x target)"
        )
    else:
        text += f"; engine failed: {row.get('engine_error')}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="1000,10000", help="fleet sizes, comma-separated")
    parser.add_argument(
        "--transports", default="inproc,mosquitto", help="inproc and/or mosquitto, comma-separated"
    )
    parser.add_argument(
        "--coordinator-devices",
        default="1000,10000,100000",
        help="fleet sizes of the coordinator's microseconds per update; '' skips them",
    )
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each sim run (>= 2)")
    parser.add_argument("--samples", type=int, default=300, help="train samples per device")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (python -m sim uses 1)"
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="MNIST IDX files")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per process")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # [kind, options] as JSON
    args = parser.parse_args(argv)
    if args.one:
        kind, options = json.loads(args.one)
        print(json.dumps(run_sim(options) if kind == "sim" else run_engine(options)))
        return 0
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (the first round is reported apart)")
    unknown = set(args.transports.split(",")) - set(TARGETS)
    if unknown:
        parser.error(f"unknown transport(s) {sorted(unknown)}: choose from {sorted(TARGETS)}")
    sizes = [int(d) for d in args.coordinator_devices.split(",") if d]
    with tempfile.TemporaryDirectory(prefix="scale-") as work:
        broker_url, broker = None, None
        if "mosquitto" in args.transports.split(","):
            broker = _mosquitto(Path(work))
            broker_url = None if broker is None else broker.url
        try:
            rows = measure(args, broker_url)
        finally:
            if broker is not None:
                broker.stop()
    result = {"sim": rows, "coordinator": coordinator_rows(sizes) if sizes else []}
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if rows and all("ratio" in r for r in rows) else 1


def _mosquitto(work: Path) -> Any:
    """A private Mosquitto whose queue for each client is unbounded (None: not installed)."""
    from tests.protocol.brokers import Mosquitto, mosquitto_binary

    if mosquitto_binary() is None:
        return None
    (work / "mosquitto").mkdir()
    return Mosquitto(work / "mosquitto", extra_config="max_queued_messages 0\n").start()


if __name__ == "__main__":
    sys.exit(main())
