"""What each transfer precision costs in accuracy and bytes, measured with ``python -m sim``.

MNIST from ``--data-dir`` (e.g. ``../shared/data``), K = 20 devices, C = 0.2, Dirichlet
alpha = 0.1, LeNet-5, in-process transport; FedAvg (E = 5, B = 32, full MNIST) and FedKF
with the dual downlink (E = 10, B = 64, 10 % of each class: a FedKF round costs about
20x a FedAvg one on this CPU). Each strategy runs once per precision, fp32 / fp16 / int8 /
int4 both ways, with the same seed, so devices, data and selections are identical and
only the transfers differ. Lossy uplinks are deltas with error feedback; lossy downlinks
are deltas against the model a device holds where it holds one.

``run`` executes the runs (skipping those whose report exists) and prints each command;
``table`` prints the Markdown table of docs/results.md, over the rounds every run of a
strategy has (a longer run is cut to the shortest): AMP at the last round and mean of
the last five rounds, the AMP change against fp32, total bytes (up + down, payload)
and their ratio to fp32, and whether the issue's targets hold (int8: at most 0.5 AMP
points and 0.27x the bytes; int4: 2 points and 0.15x).

    python -m benchmarks.precision_study run --data-dir ../shared/data --out studies
    python -m benchmarks.precision_study table --out studies
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.paper_studies import LAST, _curve, _mean, finished_report

PRECISIONS = ("fp32", "fp16", "int8", "int4")
COMMON = [
    "--transport",
    "inproc",
    "--dataset",
    "mnist",
    "--devices",
    "20",
    "--participation",
    "0.2",
    "--alpha",
    "0.1",
    "--model",
    "lenet5",
]
STRATEGIES: dict[str, dict[str, Any]] = {
    "fedavg": {"args": ["--strategy", "fedavg"], "rounds": 30, "model": "aca"},
    "fedkf": {
        "args": ["--strategy", "fedkf", "--downlink", "dual", "--class-fraction", "0.1"],
        "rounds": 15,
        "model": "oca",
    },
}
TARGETS = {"int8": (0.5, 0.27), "int4": (2.0, 0.15)}
"""Precision -> (largest AMP loss in points, largest bytes ratio) against fp32."""


def report_path(out: Path, strategy: str, precision: str, seed: int) -> Path:
    return out / f"precision-{strategy}-{precision}-s{seed}.json"


def command(strategy: str, precision: str, args: argparse.Namespace, path: Path) -> list[str]:
    spec = STRATEGIES[strategy]
    rounds = args.rounds or spec["rounds"]
    return [
        sys.executable,
        "-m",
        "sim",
        "run",
        *COMMON,
        *spec["args"],
        "--precision",
        precision,
        "--data-dir",
        str(args.data_dir),
        "--rounds",
        str(rounds),
        "--seed",
        str(args.seed),
        "--json-out",
        str(path),
    ]


def run_study(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    for strategy in args.strategies:
        for precision in args.precisions:
            path = report_path(args.out, strategy, precision, args.seed)
            if finished_report(path):
                print(f"# {path} exists, skipped", file=sys.stderr)
                continue
            cmd = command(strategy, precision, args, path)
            print(" ".join(cmd[1:]), file=sys.stderr)
            subprocess.run(cmd, check=True)


def _verdict(precision: str, loss: float, ratio: float) -> str:
    if precision not in TARGETS:
        return "-"
    max_loss, max_ratio = TARGETS[precision]
    met = []
    met.append(f"AMP {'met' if loss <= max_loss else 'MISSED'} (<= {max_loss})")
    met.append(f"bytes {'met' if ratio <= max_ratio else 'MISSED'} (<= {max_ratio}x)")
    return ", ".join(met)


def table(args: argparse.Namespace) -> None:
    print(
        f"| strategy | precision | rounds | AMP, last round | AMP, mean of last {LAST} | "
        "change vs fp32 (last / mean) | MB up | MB down | bytes vs fp32 | targets |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for strategy, spec in STRATEGIES.items():
        reports: dict[str, dict[str, Any]] = {}
        for precision in PRECISIONS:
            path = report_path(args.out, strategy, precision, args.seed)
            if path.exists():
                reports[precision] = json.loads(path.read_text())
        if "fp32" not in reports:
            print(f"{strategy}: no fp32 report in {args.out}, skipped", file=sys.stderr)
            continue
        rounds = min(len(r["rounds"]) for r in reports.values())
        base_curve = _curve(reports["fp32"], spec["model"])[:rounds]
        base_bytes = _bytes(reports["fp32"], rounds)
        for precision, report in reports.items():
            curve = _curve(report, spec["model"])[:rounds]
            up, down = _bytes(report, rounds)
            last_change = curve[-1] - base_curve[-1]
            mean_change = _mean(curve[-LAST:]) - _mean(base_curve[-LAST:])
            ratio = (up + down) / sum(base_bytes)
            print(
                f"| {strategy} ({spec['model'].upper()}) | {precision} | {rounds} | "
                f"{curve[-1]:.2f} | {_mean(curve[-LAST:]):.2f} | "
                f"{last_change:+.2f} / {mean_change:+.2f} | {up / 1e6:.2f} | "
                f"{down / 1e6:.2f} | {ratio:.3f}x | "
                f"{_verdict(precision, -mean_change, ratio)} |"
            )


def _bytes(report: dict[str, Any], rounds: int) -> tuple[int, int]:
    """Payload bytes up and down over the first ``rounds`` rounds."""
    kept = report["rounds"][:rounds]
    return sum(r["bytes_up"] for r in kept), sum(r["bytes_down"] for r in kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the emulations")
    run.add_argument("--data-dir", type=Path, required=True)
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--rounds", type=int, help="rounds of every run (default: 30 / 15)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES))
    run.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    tab = sub.add_parser("table", help="print the Markdown table from the reports")
    tab.add_argument("--out", type=Path, required=True)
    tab.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.command == "run":
        run_study(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
