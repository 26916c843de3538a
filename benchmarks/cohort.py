"""Cohort engine benchmark: client-updates per second, batched engine against the loop.

One local round of N devices (``--samples`` training samples each, MNIST-shaped, one
epoch at batch 32, SGD with momentum, the same start model), trained

- ``batched``: all at once by :func:`sim.cohort.engine.train_cohort`;
- ``loop``: one after the other on the per-device path
  (:func:`edge_client.train.local_update.local_update`), as ``--engine loop`` does. On
  large fleets the loop is timed on ``--loop-sample`` devices and scaled (the loop's time
  is linear in the devices); the row says how many it measured.

Each configuration runs in a fresh process, so its peak memory is its own: ``peak_rss``
(host, the process's maximum resident set) and, on CUDA, ``peak_gpu`` (torch's maximum
allocated). Data are random (``--data-dir`` reads MNIST instead): speed does not depend
on pixel values. Weights are copied back to the devices' models, as in the sim.

Run: ``python -m benchmarks.cohort [--models lenet5,resnet8] [--devices 50,200,1000]
[--strategies fedavg,fedkf] [--device auto|cpu|cuda] [--json PATH]``. One row per
configuration: ``engine``, ``model``, ``devices``, ``strategy``, ``device`` (with the
device's name), ``updates_per_s``, ``seconds``, ``peak_rss_bytes``, ``peak_gpu_bytes``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update
from edge_client.train.task import LocalTask
from models import Classifier, build_classifier, state_arrays
from models.devices import resolve_device
from sim.cohort.engine import Member, train_cohort
from sim.cohort.trainer import auto_max_cohort

FEDKF = {"generator_width": 16}


def device_name(device: torch.device) -> str:
    """A human name of ``device``: the GPU's, or the CPU model with its core count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} ({torch.get_num_threads()} threads)"


def _data(devices: int, samples: int, data_dir: Path | None) -> list[DeviceData]:
    rng = np.random.default_rng(0)
    if data_dir is not None:
        from sim.datasets import load_dataset

        train = load_dataset("mnist", data_dir, seed=0).train
        order = rng.permutation(len(train.y))
        xs, ys = train.x[order], train.y[order]
    out = []
    for index in range(devices):
        if data_dir is not None:
            part = np.arange(index * samples, (index + 1) * samples) % len(ys)
            x, y = xs[part], ys[part]
        else:
            x = rng.random((samples, 1, 28, 28), dtype=np.float32)
            y = rng.integers(0, 10, samples).astype(np.int64)
        out.append(DeviceData(f"dev-{index:05d}", x, y, x[:0], y[:0], 10))
    return out


def _tasks(model: Classifier, strategy: str, devices: int) -> list[LocalTask]:
    weights = state_arrays(model)
    sets = {"student": weights} if strategy == "fedkf" else {"global": weights}
    extra = FEDKF if strategy == "fedkf" else {}
    return [
        LocalTask(strategy, {"seed": i, "batch_size": 32, "local_epochs": 1, **extra}, sets)
        for i in range(devices)
    ]


def _together(data: list[DeviceData]) -> DeviceData:
    """The devices' samples as one device's."""
    x = np.concatenate([d.x for d in data])
    y = np.concatenate([d.y for d in data])
    return DeviceData("together", x, y, x[:0], y[:0], data[0].num_classes)


def _together_task(task: LocalTask, devices: int) -> LocalTask:
    """``task`` with a batch as large as a batched step over ``devices`` devices."""
    batch = int(str(task.hyperparameters["batch_size"])) * devices
    return LocalTask(task.strategy, {**task.hyperparameters, "batch_size": batch}, task.sets)


def _train(
    engine: str,
    models: list[Classifier],
    data: list[DeviceData],
    tasks: list[LocalTask],
    device: torch.device,
    limit: int,
) -> None:
    """One local round of each device (``models[i]`` on ``data[i]``): batched, or one
    after the other (``loop``; ``bound``: its one device is the cohort's samples
    together)."""
    if engine == "batched":
        members = [Member(m, d, t) for m, d, t in zip(models, data, tasks, strict=True)]
        outcomes = train_cohort(members, device=device, max_cohort=limit)
        failed = [o.error for o in outcomes if o.result is None]
        if failed:
            raise RuntimeError(f"{len(failed)} devices failed: {failed[0]}")
        return
    for model, d, task in zip(models, data, tasks, strict=True):
        local_update(model, d, task, device=device)
        model.to("cpu")


def run_one(options: dict[str, Any]) -> dict[str, Any]:
    """One configuration, measured in this process."""
    device = resolve_device(options["device"])
    torch.manual_seed(0)
    start_model = build_classifier(options["model"], num_classes=10, in_channels=1, image_size=28)
    count = options["devices"]
    timed = count if options["engine"] == "batched" else min(count, options["loop_sample"])
    data = _data(timed, options["samples"], options["data_dir"])
    tasks = _tasks(start_model, options["strategy"], timed)
    if options["engine"] == "bound":
        data = [_together(data)]
        tasks = [_together_task(tasks[0], timed)]
    limit = options["max_cohort"] or auto_max_cohort(start_model, 32, device)
    if device.type == "cuda":  # CUDA's context, cuDNN's plans: what a sim's first round pays
        warm = min(2, len(data))
        copies = [copy.deepcopy(start_model) for _ in range(warm)]
        _train(options["engine"], copies, data[:warm], tasks[:warm], device, limit)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    models = [copy.deepcopy(start_model) for _ in data]
    start = time.perf_counter()
    _train(options["engine"], models, data, tasks, device, limit)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) * count / timed
    return {
        "engine": options["engine"],
        "model": options["model"],
        "devices": count,
        "strategy": options["strategy"],
        "device": f"{device.type}: {device_name(device)}",
        "samples_per_device": options["samples"],
        "measured_devices": timed,
        "seconds": round(seconds, 3),
        "updates_per_s": round(count / seconds, 2),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="lenet5,resnet8")
    parser.add_argument("--devices", default="50,200,1000")
    parser.add_argument("--strategies", default="fedavg,fedkf")
    parser.add_argument("--engines", default="batched,loop")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--samples", type=int, default=300, help="train samples per device")
    parser.add_argument("--loop-sample", type=int, default=50, help="devices the loop times")
    parser.add_argument(
        "--max-cohort",
        type=int,
        default=None,
        help="devices per batched computation (default: the sim's, auto_max_cohort)",
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="MNIST IDX files")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a configuration, as JSON
    args = parser.parse_args(argv)
    if args.one:
        options = json.loads(args.one)
        options["data_dir"] = None if options["data_dir"] is None else Path(options["data_dir"])
        print(json.dumps(run_one(options)))
        return 0
    rows = []
    header = f"{'engine':8} {'model':8} {'strategy':8} {'devices':>7} {'updates/s':>10} "
    header += f"{'seconds':>9} {'peak RSS':>9} {'peak GPU':>9}"
    print(header, flush=True)
    for model in args.models.split(","):
        for strategy in args.strategies.split(","):
            for devices in (int(d) for d in args.devices.split(",")):
                for engine in args.engines.split(","):
                    options = {
                        "engine": engine,
                        "model": model,
                        "strategy": strategy,
                        "devices": devices,
                        "device": args.device,
                        "samples": args.samples,
                        "loop_sample": args.loop_sample,
                        "max_cohort": args.max_cohort,
                        "data_dir": None if args.data_dir is None else str(args.data_dir),
                    }
                    command = [
                        sys.executable,
                        "-m",
                        "benchmarks.cohort",
                        "--one",
                        json.dumps(options),
                    ]
                    done = subprocess.run(command, capture_output=True, text=True, check=False)
                    if done.returncode != 0:
                        print(f"{engine} {model} {strategy} {devices}: failed\n{done.stderr}")
                        return 1
                    row = json.loads(done.stdout.strip().splitlines()[-1])
                    rows.append(row)
                    print(
                        f"{engine:8} {model:8} {strategy:8} {devices:7d} "
                        f"{row['updates_per_s']:10.2f} {row['seconds']:9.2f} "
                        f"{row['peak_rss_bytes'] / 2**20:8.0f}M "
                        f"{row['peak_gpu_bytes'] / 2**20:8.0f}M",
                        flush=True,
                    )
    if rows:
        print(f"device: {rows[0]['device']}")
    for row in rows:
        if row["engine"] == "loop":
            continue
        loop = [
            r
            for r in rows
            if r["engine"] == "loop"
            and all(r[k] == row[k] for k in ("model", "strategy", "devices"))
        ]
        if loop:
            speedup = row["updates_per_s"] / loop[0]["updates_per_s"]
            print(
                f"{row['engine']} / loop: {row['model']} {row['strategy']} {row['devices']} devices: "
                f"{speedup:.2f}x"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
