"""The vs-Flower workload through Flower's simulation engine (run by the Flower venv's python).

This file is NOT part of the project: ``benchmarks/vs_flower.py`` runs it with the python
of a separate virtual environment (``.bench-venvs/flower/``) that holds Flower, Ray and a
CPU build of torch; the project's own environment never has ``flwr``. It imports nothing
from the project (the Flower venv does not install it): the LeNet-5 below is the same
network as ``models/lenet.py`` (61,706 parameters for 1x28x28 and 10 classes), and the
training loop follows ``edge_client/train/training.py`` (a fresh SGD optimizer each
round; each epoch one seeded permutation; every batch kept, the last one may be smaller).

The data come ready-partitioned from ``vs_flower.py`` in ``--data DIR`` (``.npy`` files,
see :func:`_load`), so both systems train on the very same samples. Each Ray actor maps
the training arrays (``mmap_mode="r"``) and copies out only its node's slice.

What runs: ``flwr.simulation.run_simulation`` with a ``ServerApp`` (the Message API's
``flwr.serverapp.strategy.FedAvg``, every node every round, no federated evaluation) and
a ``ClientApp`` whose ``train`` trains LeNet-5 locally; ``num_supernodes`` = the number
of partitions. Ray backend, ``client_resources = {"num_cpus": --cpus-per-client,
"num_gpus": 0}``: with 1 CPU per client Ray runs one actor per core, two trainings at
once on a 2-core machine, each with one torch thread -- the same parallelism as
``python -m sim`` (``--train-slots`` = CPU count, one torch thread per training).
Flower's default is 2 CPUs per client, which would leave one core idle here.

After each round the server evaluates the global model on every node's test split and on
the global test split (``evaluate_fn``), as ``python -m sim`` does after each round, so
both do the same evaluation work. The round time written to ``--json-out`` runs from
``configure_train`` to the end of ``aggregate_train`` (evaluation excluded, as in the
sim's ``wall_s``).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import platform
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

# flwr lives only in Flower's venv (benchmarks/vs_flower.py builds it), never in the
# project's: it is loaded by name, so that neither the project's dependency checks nor
# its mypy look for it, and a run in the wrong venv stops with one clear line.
try:
    flwr: Any = importlib.import_module("flwr")
    _app: Any = importlib.import_module("flwr.app")
    ClientApp: Any = importlib.import_module("flwr.clientapp").ClientApp
    ServerApp: Any = importlib.import_module("flwr.serverapp").ServerApp
    FedAvg: Any = importlib.import_module("flwr.serverapp.strategy").FedAvg
    run_simulation: Any = importlib.import_module("flwr.simulation").run_simulation
except ModuleNotFoundError as exc:
    raise SystemExit(
        f"flower_workload.py runs in Flower's venv ({exc}); build it with "
        "python -m benchmarks.vs_flower --setup"
    ) from None
ArrayRecord, ConfigRecord, Message = _app.ArrayRecord, _app.ConfigRecord, _app.Message
MetricRecord, RecordDict = _app.MetricRecord, _app.RecordDict

EVAL_BATCH = 1000


class LeNet5(nn.Module):
    """models/lenet.py's LeNet-5 for 1x28x28: features -> head (Linear 84 -> classes)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 120, 5),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(120, 84),
            nn.ReLU(),
        )
        self.head = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.features(x))
        return out


# ----------------------------------------------------------------------------- data

_CACHE: dict[str, Any] = {}


def _load(data: Path, name: str, *, mmap: bool = True) -> np.ndarray:
    """One array of the prepared data: ``{train,devtest,test}_{x,y}.npy`` and
    ``{train,devtest}_offsets.npy`` (node i's rows are ``offsets[i]:offsets[i + 1]``)."""
    key = f"{data}/{name}"
    if key not in _CACHE:
        _CACHE[key] = np.load(data / f"{name}.npy", mmap_mode="r" if mmap else None)
    array: np.ndarray = _CACHE[key]
    return array


def _partition(data: Path, split: str, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    offsets = _load(data, f"{split}_offsets", mmap=False)
    lo, hi = int(offsets[index]), int(offsets[index + 1])
    x = torch.from_numpy(np.array(_load(data, f"{split}_x")[lo:hi]))
    y = torch.from_numpy(np.array(_load(data, f"{split}_y")[lo:hi]))
    return x, y


# ------------------------------------------------------------------------ training


def train_local(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float,
    seed: int,
) -> float:
    """Mini-batch SGD on cross-entropy; the mean loss over all samples seen."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(seed)
    model.train()
    total, seen = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), batch_size):
            index = order[start : start + batch_size]
            xb, yb = x[index], y[index]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(index)
            seen += len(index)
    return total / max(1, seen)


@torch.no_grad()
def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-sample correctness (bool) of ``model`` on ``x``, in batches."""
    model.eval()
    hits = []
    for start in range(0, len(x), EVAL_BATCH):
        xb = torch.from_numpy(np.array(x[start : start + EVAL_BATCH]))  # a writable copy
        pred = model(xb).argmax(dim=1).numpy()
        hits.append(pred == np.asarray(y[start : start + EVAL_BATCH]))
    return np.concatenate(hits) if hits else np.zeros(0, dtype=bool)


# ------------------------------------------------------------------------- the apps


def make_client_app(data: Path) -> Any:
    app = ClientApp()

    @app.train()  # type: ignore[untyped-decorator]
    def train(msg: Any, context: Any) -> Any:
        torch.set_num_threads(1)  # one thread per training, as the sim's
        index = int(context.node_config["partition-id"])
        config = msg.content["config"]
        model = LeNet5()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = _partition(data, "train", index)
        loss = train_local(
            model,
            x,
            y,
            epochs=int(config["local-epochs"]),
            batch_size=int(config["batch-size"]),
            lr=float(config["lr"]),
            momentum=float(config["momentum"]),
            seed=int(config["seed"]) * 100_003 + index * 1_009 + int(config["server-round"]),
        )
        metrics = MetricRecord({"train_loss": loss, "num-examples": len(x)})
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
        return Message(content=content, reply_to=msg)

    return app


class TimedFedAvg(FedAvg):  # type: ignore[misc]
    """FedAvg that notes when each round's training starts and is aggregated."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.started: dict[int, float] = {}
        self.aggregated: dict[int, float] = {}

    def configure_train(
        self, server_round: int, arrays: Any, config: Any, grid: Any
    ) -> Iterable[Any]:
        self.started[server_round] = time.perf_counter()
        return super().configure_train(server_round, arrays, config, grid)  # type: ignore[no-any-return]

    def aggregate_train(self, server_round: int, replies: Iterable[Any]) -> Any:
        result = super().aggregate_train(server_round, replies)
        self.aggregated[server_round] = time.perf_counter()
        return result


def make_server_app(args: argparse.Namespace, report: dict[str, Any]) -> Any:
    app = ServerApp()
    data: Path = args.data

    def evaluate(server_round: int, arrays: Any) -> Any:
        if server_round == 0:
            return None  # the sim evaluates after each round only
        model = LeNet5()
        model.load_state_dict(arrays.to_torch_state_dict())
        offsets = _load(data, "devtest_offsets", mmap=False)
        hits = accuracy(model, _load(data, "devtest_x"), _load(data, "devtest_y"))
        per_node = [
            float(hits[lo:hi].mean()) * 100 for lo, hi in itertools.pairwise(offsets) if hi > lo
        ]
        global_hits = accuracy(model, _load(data, "test_x"), _load(data, "test_y"))
        metrics = {"amp": float(np.mean(per_node)), "global_acc": float(global_hits.mean() * 100)}
        report["evaluations"].append({"round": server_round, **metrics})
        return MetricRecord(metrics)

    @app.main()  # type: ignore[untyped-decorator]
    def main(grid: Any, context: Any) -> None:
        torch.set_num_threads(1)  # the server's evaluation: one thread, as the sim's
        nodes = args.nodes
        strategy = TimedFedAvg(
            fraction_train=1.0,
            fraction_evaluate=0.0,  # no federated evaluation (the sim has none)
            min_train_nodes=nodes,
            min_available_nodes=nodes,
        )
        torch.manual_seed(args.seed)
        config = ConfigRecord(
            {
                "local-epochs": args.local_epochs,
                "batch-size": args.batch_size,
                "lr": args.lr,
                "momentum": args.momentum,
                "seed": args.seed,
            }
        )
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(LeNet5().state_dict()),
            train_config=config,
            num_rounds=args.rounds,
            evaluate_fn=evaluate,
        )
        report["rounds"] = [
            {"round": r, "wall_s": strategy.aggregated[r] - strategy.started[r]}
            for r in sorted(strategy.aggregated)
        ]

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="folder of prepared .npy files")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpus-per-client",
        type=float,
        default=1.0,
        help="Ray client_resources num_cpus (1: one actor per core)",
    )
    parser.add_argument("--json-out", type=Path, help="write round times and versions here")
    args = parser.parse_args(argv)
    args.nodes = len(_load(args.data, "train_offsets", mmap=False)) - 1
    started = time.perf_counter()
    report: dict[str, Any] = {"evaluations": [], "rounds": []}
    run_simulation(
        server_app=make_server_app(args, report),
        client_app=make_client_app(args.data),
        num_supernodes=args.nodes,
        backend_config={
            "client_resources": {"num_cpus": args.cpus_per_client, "num_gpus": 0.0},
        },
    )
    report.update(
        simulation_s=time.perf_counter() - started,
        nodes=args.nodes,
        versions={
            "flwr": flwr.__version__,
            "ray": _version("ray"),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
    )
    if len(report["rounds"]) != args.rounds:
        print(
            f"flower_workload: {len(report['rounds'])} of {args.rounds} rounds ran", file=sys.stderr
        )
        return 1
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


def _version(distribution: str) -> str:
    from importlib.metadata import version

    return version(distribution)


if __name__ == "__main__":
    sys.exit(main())
