"""Reproduce the FedKF and FedGen papers' headline claims with ``python -m sim``.

Two studies, each a set of ``python -m sim`` runs on real data (``--data-dir``, e.g.
``../shared/data``), in-process transport, one JSON report per run and seed:

- ``fedkf``: the FedKF paper's EMNIST letters protocol (10 % of each class, LeNet-5,
  K = 20 devices, C = 0.2, E = 10, B = 64, Dirichlet alpha = 0.1): FedAvg (with its OCA
  model, the paper's "FedAvg (OCA)"), FedKF- (single downlink) and FedKF (dual
  downlink), each at the runtime's cost settings and as published; each run reports its
  ACA and OCA models every round and its devices' training seconds.
- ``fedgen``: the FedGen paper's MNIST protocol (20 devices, 10 active, alpha = 0.1, 20
  local steps of batch 32, FedGen's CNN): FedAvg and FedGen with full sharing and with
  prediction-layer-only sharing (head), where each device is evaluated with its own
  feature extractor and the global head.

``run`` executes the runs (skipping those whose report exists) and prints each command;
``table`` prints the Markdown tables of docs/results.md from the reports and, with
``--plots DIR``, writes the AMP-per-round plots (needs matplotlib). Metrics are computed
on the devices' own test splits (AMP, FM, WLP as in the FedKF paper); nothing is tuned
on them.

    python -m benchmarks.paper_studies run --study fedkf --data-dir ../shared/data \\
        --rounds 50 --seeds 0 --out studies
    python -m benchmarks.paper_studies table --out studies --plots docs/img
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COMMON = ["--transport", "inproc", "--alpha", "0.1", "--devices", "20"]
PAPER = [
    *("--generator-every", "1", "--sample-reuse", "1", "--generator-batch-size", "0"),
    *("--generator-width", "16"),
]
"""FedKF's cost settings as the paper has them: a generator step before every batch and
a fresh generated batch of B for every distillation step, with the generator 16 wide
(the paper's is 64 wide: 6x a device's time again on this CPU) as this study ran before
the runtime's cheaper defaults (docs/modes.md, "FedKF's cost")."""
STUDIES: dict[str, dict[str, Any]] = {
    "fedkf": {
        "args": [
            "--dataset",
            "emnist-letters",
            "--class-fraction",
            "0.1",
            "--participation",
            "0.2",
            "--model",
            "lenet5",
            "--local-epochs",
            "10",
            "--batch-size",
            "64",
        ],
        "runs": {
            "emnist-fedavg": ["--strategy", "fedavg_oca"],
            "emnist-fedkf-single": ["--strategy", "fedkf", "--downlink", "single"],
            "emnist-fedkf-dual": ["--strategy", "fedkf", "--downlink", "dual"],
            "emnist-fedkf-paper-single": ["--strategy", "fedkf", "--downlink", "single", *PAPER],
            "emnist-fedkf-paper-dual": ["--strategy", "fedkf", "--downlink", "dual", *PAPER],
        },
        # row label -> (run, model), in the paper's Table V order; FedKF at the
        # runtime's defaults, then as published
        "rows": {
            "FedAvg": ("emnist-fedavg", "aca"),
            "FedAvg (OCA)": ("emnist-fedavg", "oca"),
            "FedKF- (ACA)": ("emnist-fedkf-single", "aca"),
            "FedKF- (OCA)": ("emnist-fedkf-single", "oca"),
            "FedKF (ACA)": ("emnist-fedkf-dual", "aca"),
            "FedKF (OCA)": ("emnist-fedkf-dual", "oca"),
            "FedKF- as published (ACA)": ("emnist-fedkf-paper-single", "aca"),
            "FedKF- as published (OCA)": ("emnist-fedkf-paper-single", "oca"),
            "FedKF as published (ACA)": ("emnist-fedkf-paper-dual", "aca"),
            "FedKF as published (OCA)": ("emnist-fedkf-paper-dual", "oca"),
        },
        "paper": {
            "FedAvg": 75.61,
            "FedAvg (OCA)": 78.38,
            "FedKF (OCA)": 82.94,
            "FedKF as published (OCA)": 82.94,
        },
    },
    "fedgen": {
        "args": [
            "--dataset",
            "mnist",
            "--participation",
            "0.5",
            "--model",
            "fedgen_cnn",
            "--local-steps",
            "20",
            "--batch-size",
            "32",
        ],
        "runs": {
            "mnist-fedavg-full": ["--strategy", "fedavg"],
            "mnist-fedgen-full": ["--strategy", "fedgen"],
            "mnist-fedavg-head": ["--strategy", "fedavg", "--sharing", "head"],
            "mnist-fedgen-head": ["--strategy", "fedgen", "--sharing", "head"],
        },
        "rows": {
            "FedAvg, full model": ("mnist-fedavg-full", "aca"),
            "FedGen, full model": ("mnist-fedgen-full", "aca"),
            "FedAvg, head only": ("mnist-fedavg-head", "aca"),
            "FedGen, head only": ("mnist-fedgen-head", "aca"),
        },
        "paper": {
            "FedAvg, full model": 90.16,
            "FedGen, full model": 93.03,
            "FedAvg, head only": 58.39,
            "FedGen, head only": 65.42,
        },
    },
}
LAST = 5  # rounds averaged for the "last rounds" column


def report_path(out: Path, run: str, seed: int) -> Path:
    return out / f"{run}-s{seed}.json"


def finished_report(path: Path) -> bool:
    """Whether ``path`` holds the report of a whole run (not of a run interrupted with
    Ctrl-C, which reports its finished rounds with ``final.interrupted``)."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    final = report.get("final") if isinstance(report, dict) else None
    return isinstance(final, dict) and final.get("interrupted") is not True


def run_sim(path: Path, seed: int, arguments: Sequence[str]) -> None:
    """Run ``python -m sim ARGUMENTS --seed SEED --json-out PATH`` unless ``path``
    holds a whole run's report, printing the command (the reports of a study survive an
    interrupted study; an interrupted run is run again)."""
    if finished_report(path):
        print(f"# {path} exists, skipped", file=sys.stderr)
        return
    command = [
        sys.executable,
        "-m",
        "sim",
        *arguments,
        "--seed",
        str(seed),
        "--json-out",
        str(path),
    ]
    print(" ".join(command[1:]), file=sys.stderr, flush=True)
    subprocess.run(command, check=True)


def run_study(args: argparse.Namespace) -> None:
    study = STUDIES[args.study]
    args.out.mkdir(parents=True, exist_ok=True)
    unknown = set(args.runs or ()) - set(study["runs"])
    if unknown:
        raise SystemExit(f"--runs: {', '.join(sorted(unknown))} not in {', '.join(study['runs'])}")
    for seed in args.seeds:
        for run, extra in study["runs"].items():
            if args.runs and run not in args.runs:
                continue
            arguments = [*COMMON, *study["args"], *extra, "--data-dir", str(args.data_dir)]
            arguments += ["--rounds", str(args.rounds)]
            run_sim(report_path(args.out, run, seed), seed, arguments)


def load_reports(out: Path, run: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{run}-s*.json"))]


def _curve(report: dict[str, Any], model: str) -> list[float]:
    return [r["models"][model]["amp"] for r in report["rounds"]]


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    text = f"{_mean(values):.2f}"
    return text + (f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else "")


def _device_seconds(report: dict[str, Any]) -> float:
    """A run's mean training seconds of a device per round (the rounds that report it)."""
    return _mean([r["device_train_s"] for r in report["rounds"] if r.get("device_train_s")])


def _first_reach(curve: Sequence[float], target: float) -> int | None:
    return next((i + 1 for i, amp in enumerate(curve) if amp >= target), None)


def table(args: argparse.Namespace) -> None:
    for name, study in STUDIES.items():
        reports = {run: load_reports(args.out, run) for run in study["runs"]}
        missing = sorted(run for run, found in reports.items() if not found)
        if missing:
            print(f"{name}: no reports of {', '.join(missing)} in {args.out}", file=sys.stderr)
        rows = {label: row for label, row in study["rows"].items() if reports[row[0]]}
        if next(iter(study["rows"])) not in rows:
            continue
        first_label = next(iter(rows))
        base_run, base_model = rows[first_label]
        # each seed's FedAvg final AMP, for the same seed's runs (a run may lack seeds)
        targets = {r["config"]["seed"]: _curve(r, base_model)[-1] for r in reports[base_run]}
        rounds = len(reports[base_run][0]["rounds"])
        seeds = len(reports[base_run])
        print(f"\n{name}: {rounds} rounds, {seeds} seed(s); AMP / WLP in %, FM in %²\n")
        print(
            f"| model | AMP, round {rounds} | AMP, mean of the last {LAST} | FM | WLP | "
            f"rounds to {first_label}'s final AMP | paper AMP |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for label, (run, model) in rows.items():
            finals = [r["rounds"][-1]["models"][model] for r in reports[run]]
            curves = [_curve(r, model) for r in reports[run]]
            reach = [
                _first_reach(c, targets[r["config"]["seed"]])
                if r["config"]["seed"] in targets
                else None
                for c, r in zip(curves, reports[run], strict=True)
            ]
            reached = "/".join("-" if x is None else str(x) for x in reach)
            print(
                f"| {label} | {spread([f['amp'] for f in finals])} | "
                f"{spread([_mean(c[-LAST:]) for c in curves])} | "
                f"{spread([f['fm'] for f in finals])} | {spread([f['wlp'] for f in finals])} | "
                f"{reached} | {study['paper'].get(label, '-')} |"
            )
        bytes_rows = {run for run, _ in rows.values()}
        print(
            "\n| run | MB up per round | MB down per round | device training s per round "
            "| wall s per round |"
        )
        print("| --- | --- | --- | --- | --- |")
        for run in sorted(bytes_rows):
            finals = [r["final"] for r in reports[run]]
            per_round = [f["rounds"] for f in finals]
            up = _mean([f["bytes_up"] / n / 1e6 for f, n in zip(finals, per_round, strict=True)])
            down = _mean(
                [f["bytes_down"] / n / 1e6 for f, n in zip(finals, per_round, strict=True)]
            )
            wall = _mean([f["wall_s"] / n for f, n in zip(finals, per_round, strict=True)])
            device = [_device_seconds(r) for r in reports[run]]
            print(f"| {run} | {up:.2f} | {down:.2f} | {spread(device)} | {wall:.1f} |")
        if args.plots is not None:
            _plot(name, rows, reports, args.plots)


def _plot(
    name: str,
    rows: dict[str, tuple[str, str]],
    reports: dict[str, list[dict[str, Any]]],
    out: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (run, model) in rows.items():
        curves = [_curve(r, model) for r in reports[run]]
        mean = [statistics.fmean(v) for v in zip(*curves, strict=True)]
        ax.plot(range(1, len(mean) + 1), mean, label=label)
    ax.set_xlabel("round")
    ax.set_ylabel("AMP (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{name}_amp.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a study's emulations")
    run.add_argument("--study", choices=list(STUDIES), required=True)
    run.add_argument("--data-dir", type=Path, required=True)
    run.add_argument("--rounds", type=int, default=100)
    run.add_argument("--seeds", type=int, nargs="+", default=[0])
    run.add_argument("--runs", nargs="+", help="only these of the study's runs (default: all)")
    run.add_argument("--out", type=Path, default=Path("studies"))
    show = sub.add_parser("table", help="print the tables from the reports")
    show.add_argument("--out", type=Path, default=Path("studies"))
    show.add_argument("--plots", type=Path, help="write AMP-per-round PNGs here")
    args = parser.parse_args()
    if args.command == "run":
        run_study(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
