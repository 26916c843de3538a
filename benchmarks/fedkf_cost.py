"""A device's FedKF round against its FedAvg round, for each setting of FedKF's cost knobs.

One emulated device trains one round the way a real device does
(:func:`edge_client.train.local_update.local_update`, one torch thread, as on a Raspberry
Pi): LeNet-5 on the FedKF study's device (499 samples of 1x28x28, the mean of the EMNIST
study's 12,480 x 0.8 / 20), E = 10 local epochs of B = 64, SGD with momentum. The samples
are random (the time of a step does not depend on them); the teacher is another LeNet-5.

Settings (``--settings``, comma-separated; each ``name`` below):

- ``fedavg``: FedAvg's round, the reference the ratios divide by;
- ``paper``: FedKF's steps as published: the generator steps before every batch, a
  fresh generated batch of B per step (``generator_every 1``, ``sample_reuse 1``,
  ``generator_batch_size 0``), at width 16 (the paper's generator is 64 wide: 80x
  FedAvg's step, see :mod:`edge_client.train.strategies.fedkf`);
- ``default``: what a coordinator sends by default;
- any other name is ``every-E_reuse-R_batch-G_width-W`` (for example
  ``every-4_reuse-4_batch-32_width-8``): the generator steps every E batches, a generated
  batch of G samples (0: B) serves R steps, the generator's base width W.

Each setting's first round is a warm-up (the device's generator is built then); the
figure is the median of ``--repeat`` rounds after it, the settings taking turns (this
machine's speed drifts by tens of percent between minutes). Prints one row per setting:
seconds per round and the ratio to ``fedavg`` (issue 29's target: <= 3x); ``--json``
prints the rows as JSON.

Run from the repository root: ``python -m benchmarks.fedkf_cost [--repeat 3]
[--settings fedavg,paper,default,every-4_reuse-4_batch-32_width-8]``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from typing import Any

import numpy as np
import torch

from coordinator.strategies.fedkf import FedKF
from edge_client.train.data import DeviceData
from edge_client.train.local_update import local_update
from edge_client.train.task import LocalTask
from models import build_classifier, state_arrays

SAMPLES = 499
"""The FedKF study's samples per device (12,480 x 0.8 / 20)."""
EPOCHS, BATCH = 10, 64
"""The FedKF paper's local epochs and batch size."""
DEFAULT_SETTINGS = "fedavg,paper,default"
_KNOBS = re.compile(r"every-(\d+)_reuse-(\d+)_batch-(\d+)_width-(\d+)")


def knobs(name: str) -> dict[str, Any]:
    """The task's FedKF settings a setting's name stands for (see the module's doc).

    ``default`` is the runtime's defaults (none given); ``fedavg`` is not a FedKF setting.

    Raises:
        ValueError: a name that is none of the forms above.
    """
    if name == "default":  # what a coordinator sends by default (the rest: the task's)
        return {"generator_batch_size": FedKF.training_defaults["generator_batch_size"]}
    if name == "paper":
        return {
            "generator_every": 1,
            "sample_reuse": 1,
            "generator_batch_size": 0,
            "generator_width": 16,
        }
    match = _KNOBS.fullmatch(name)
    if match is None:
        raise ValueError(
            f"unknown setting {name!r}: use fedavg, paper, default or every-E_reuse-R_batch-G_width-W"
        )
    every, reuse, batch, width = (int(v) for v in match.groups())
    return {
        "generator_every": every,
        "sample_reuse": reuse,
        "generator_batch_size": batch,
        "generator_width": width,
    }


def _device(seed: int) -> DeviceData:
    rng = np.random.default_rng(seed)
    x = rng.random((SAMPLES, 1, 28, 28), dtype=np.float32)
    y = rng.integers(0, 26, SAMPLES).astype(np.int64)
    return DeviceData("dev-000", x, y, x[:0], y[:0], 26)


class _Setting:
    """One setting's device: its model, teacher, data, learning state and round times."""

    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        self.model = build_classifier("lenet5", num_classes=26)
        torch.manual_seed(1)
        teacher = build_classifier("lenet5", num_classes=26)
        self.data = _device(0)
        self.hyper: dict[str, Any] = {"local_epochs": EPOCHS, "batch_size": BATCH, "lr": 0.01}
        if name == "fedavg":
            self.strategy, self.sets = "fedavg", {"global": state_arrays(self.model)}
        else:
            self.strategy = "fedkf"
            self.sets = {"student": state_arrays(self.model), "teacher": state_arrays(teacher)}
            self.hyper |= knobs(name)
        self.state: dict[str, Any] = {}
        self.rounds = 0
        self.times: list[float] = []

    def round(self) -> float:
        """One local round's seconds (the first builds the device's generator)."""
        task = LocalTask(self.strategy, {**self.hyper, "seed": self.rounds}, self.sets)
        self.rounds += 1
        start = time.perf_counter()
        local_update(self.model, self.data, task, self.state)
        return time.perf_counter() - start


def round_seconds(names: list[str], repeat: int) -> dict[str, float]:
    """Each setting's median seconds per round over ``repeat`` rounds after a warm-up
    round; the settings take turns, so a machine whose speed drifts slows them alike."""
    settings = {name: _Setting(name) for name in names}
    for setting in settings.values():
        setting.round()
    for index in range(repeat):
        for name, setting in settings.items():
            setting.times.append(setting.round())
            print(f"  round {index + 1}/{repeat} {name}: {setting.times[-1]:.2f} s", flush=True)
    return {name: statistics.median(s.times) for name, s in settings.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default=DEFAULT_SETTINGS, help="comma-separated")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds per setting")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    names = [n for n in args.settings.split(",") if n]
    for name in names:
        if name != "fedavg":
            knobs(name)  # a bad name fails before anything runs
    if "fedavg" not in names:
        names.insert(0, "fedavg")
    torch.set_num_threads(1)
    seconds = round_seconds(names, args.repeat)
    base = seconds["fedavg"]
    rows = [
        {"setting": n, "seconds_per_round": round(s, 3), "vs_fedavg": round(s / base, 2)}
        for n, s in seconds.items()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"\nLeNet-5, {SAMPLES} samples, E = {EPOCHS}, B = {BATCH}, one torch thread")
    print(f"{'setting':<40} {'s / round':>10} {'vs FedAvg':>10}")
    for row in rows:
        print(f"{row['setting']:<40} {row['seconds_per_round']:>10.2f} {row['vs_fedavg']:>9.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
