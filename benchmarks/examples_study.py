"""The worked examples' accuracy: FedAvg, FedKF and FedDF against a centralised baseline.

For each example of :mod:`edgefl_examples` (the wearable's BasicMotions with a 1-D CNN,
the breast-cancer features with an MLP) and each seed, this trains:

- **centralised**: the same model on all the training data in one place, with the
  devices' optimizer (SGD, momentum 0.9) and batch size, for as many epochs as a device
  trains over the whole run (rounds x local epochs);
- **FedAvg, FedKF, FedDF** through ``python -m sim`` (in process, every device every
  round, Dirichlet alpha 0.5 label skew; FedKF with its dual downlink, FedDF distilling on
  server-generated samples since there is no proxy data);

and evaluates each on the example's test split. It prints a Markdown table: accuracy
mean +- std over the seeds and, for the federated runs, the payload bytes per round (up
+ down). docs/results.md ("Worked examples") holds its output.

    python -m benchmarks.examples_study --seeds 0 1 2

Needs the ``examples`` extra (``pip install "edgefl[examples]"``); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from coordinator.config import TrainingSettings
from coordinator.evaluation import evaluate_accuracy
from edge_client.train.training import TrainConfig, train_local
from edgefl_examples import tabular, wearable
from edgefl_examples._data import Dataset, save_dataset
from models import build_classifier, seeded
from sim.run import SimConfig, run_simulation

STRATEGIES = ("fedavg", "fedkf", "feddf")


@dataclass(frozen=True)
class Example:
    """One worked example and the run it is measured with."""

    name: str
    model: str
    load: Callable[[], Dataset]
    devices: int
    rounds: int
    local_epochs: int
    batch_size: int
    lr: float


EXAMPLES = (
    Example("wearable", "edgefl_examples.wearable:build_cnn", wearable.load, 4, 20, 2, 8, 0.05),
    Example("tabular", "edgefl_examples.tabular:build_mlp", tabular.load, 5, 20, 2, 16, 0.05),
)


def centralised(example: Example, data: Dataset, seed: int) -> float:
    """Test accuracy (percent) of the model trained on all the training data."""
    shape = tuple(data["x"].shape[1:])
    classes = int(data["num_classes"])
    with seeded(seed):
        model = build_classifier(example.model, num_classes=classes, input_shape=shape)
    config = TrainConfig(
        local_epochs=example.rounds * example.local_epochs,
        batch_size=example.batch_size,
        lr=example.lr,
        seed=seed,
    )
    train_local(model, data["x"], data["y"], config)
    return 100.0 * evaluate_accuracy(model, data["x_test"], data["y_test"])


def federated(example: Example, path: Path, strategy: str, seed: int) -> tuple[float, float]:
    """Test accuracy (percent) of the run's final model and its bytes per round."""
    settings: dict[str, object] = {
        "dataset": "npz",
        "data_dir": path,
        "model": example.model,
        "strategy": strategy,
        "devices": example.devices,
        "rounds": example.rounds,
        "participation": 1.0,
        "alpha": 0.5,
        "seed": seed,
        "transport": "inproc",
        "training": TrainingSettings(
            local_epochs=example.local_epochs, batch_size=example.batch_size, lr=example.lr
        ),
    }
    if strategy == "feddf":
        settings["distill_data"] = "generator"
    report = run_simulation(SimConfig.model_validate(settings))
    final = report.final
    metrics = report.rounds[-1].models[final["final_model"]]
    assert metrics.global_acc is not None, "the npz dataset has a test split"
    per_round = (final["bytes_up"] + final["bytes_down"]) / max(1, final["rounds"])
    return metrics.global_acc, per_round


def _cell(values: Sequence[float]) -> str:
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.1f} +- {spread:.1f}"


def _seeds(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def study(seeds: Sequence[int], out: Path) -> list[str]:
    """The table's rows, measuring every example, method and seed."""
    rows = [
        "| example | samples (train / test), shape | method | test accuracy (%) | bytes / round |",
        "| --- | --- | --- | --- | --- |",
    ]
    for example in EXAMPLES:
        data = example.load()
        path = save_dataset(out / f"{example.name}.npz", data)
        about = f"{len(data['y'])} / {len(data['y_test'])}, {tuple(data['x'].shape[1:])}"
        started = time.perf_counter()
        central = [centralised(example, data, seed) for seed in seeds]
        rows.append(f"| {example.name} | {about} | centralised | {_cell(central)} | - |")
        print(
            f"{example.name}: centralised {_cell(central)} (by seed: {_seeds(central)})", flush=True
        )
        for strategy in STRATEGIES:
            runs = [federated(example, path, strategy, seed) for seed in seeds]
            accuracy = _cell([a for a, _ in runs])
            per_round = statistics.fmean(b for _, b in runs)
            rows.append(
                f"| {example.name} | {about} | {strategy} | {accuracy} | {per_round:,.0f} |"
            )
            by_seed = _seeds([a for a, _ in runs])
            print(f"{example.name}: {strategy} {accuracy} (by seed: {by_seed})", flush=True)
        print(f"{example.name}: {time.perf_counter() - started:.0f} s", flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--out", type=Path, help="folder for the examples' npz files (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        rows = study(args.seeds, args.out)
    else:
        with tempfile.TemporaryDirectory() as folder:
            rows = study(args.seeds, Path(folder))
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
