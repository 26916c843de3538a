"""Heterogeneous fleets and one-shot learning with ``python -m sim``: the studies of
docs/results.md ("Heterogeneous fleets").

Four studies, each a set of ``python -m sim`` runs on real data (``--data-dir``, e.g.
``../shared/data``: MNIST for training, EMNIST letters as the unlabeled proxy images of
FedDF), in-process transport, one JSON report per run and seed:

- ``oneshot``: the DENSE paper's one-shot MNIST setting (Table 1): 5 devices, Dirichlet
  alpha 0.1 and 0.5, one round in which every device trains once and uploads once;
  FedAvg, FedDF (on proxy images, and on generated ones: ``feddf-gen``) and DENSE on the
  same device updates (same seed: same partition, same local training), and oneshot
  (the label-aware ensemble with hard samples; its record also holds its ensemble's
  accuracy, the ceiling), without the devices' label counts (the default, and the
  energy gate alone: ``oneshot-energy``) and with them (``oneshot-counts``). Accuracy
  of the delivered model on the MNIST test set.
- ``oneshot-letters``: the same one-shot setting on EMNIST letters (26 classes):
  one-shot FedAvg against oneshot, without and with label counts.
- ``hetero``: a fleet of three architectures (a third each of resnet8, lenet5,
  fedgen_cnn); FedAvg, which can only average within an architecture group, against
  FedDF, which distils every group from the ensemble of all of them. Accuracy of each
  group's model on the MNIST test set after the same rounds, and the bytes moved.
- ``mixed``: one architecture (lenet5) at three precisions: a third of the devices
  train fp32, a third int8 (quantization-aware), a third with binarized weights;
  FedAvg against FedDF.

``run`` executes the runs (skipping those whose report exists) and prints each command;
``table`` prints the Markdown tables from the reports.

    python -m benchmarks.hetero_studies run --study oneshot --data-dir ../shared/data \\
        --seeds 0 1 2 --out studies
    python -m benchmarks.hetero_studies table --out studies
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.paper_studies import load_reports, report_path, run_sim, spread


def _proxy(size: int) -> list[str]:
    """FedDF's unlabeled proxy images: ``size`` EMNIST letters (another domain than
    MNIST)."""
    return ["--proxy-data", "{data}/emnist-letters", "--proxy-size", str(size)]


COMMON = ["--transport", "inproc", "--dataset", "mnist", "--batch-size", "64"]
FLEET = [
    *("--devices", "15", "--participation", "0.4", "--alpha", "0.5"),
    *("--local-epochs", "3", "--rounds", "10"),
]
"""The heterogeneous and mixed-precision fleets: 15 devices, 6 a round, 10 rounds."""

ONESHOT_KINDS: dict[str, list[str]] = {
    "fedavg": ["--strategy", "fedavg"],
    "feddf": ["--strategy", "feddf", *_proxy(20000)],
    "feddf-gen": ["--strategy", "feddf", "--distill-data", "generator"],
    "dense": ["--strategy", "dense"],
    "oneshot": ["--strategy", "oneshot"],
    "oneshot-energy": ["--strategy", "oneshot", "--oneshot-weighting", "energy"],
    "oneshot-counts": ["--strategy", "oneshot", "--oneshot-weighting", "counts"],
}
"""The one-shot runs per alpha: the server steps compared on the same device updates
(``feddf-gen``: FedDF distilling on images of a generator instead of proxy images;
``oneshot-energy``: oneshot's ensemble gated by the members' energies alone, without the
class shares it estimates; ``oneshot-counts``: oneshot weighing its ensemble by the
devices' label counts)."""

ONESHOT_ARGS = [
    *("--devices", "5", "--participation", "1", "--rounds", "1"),
    *("--model", "lenet5", "--local-epochs", "5"),
]
LETTERS_KINDS = ("fedavg", "oneshot", "oneshot-energy", "oneshot-counts")
"""The one-shot runs on EMNIST letters: oneshot against the one-shot FedAvg floor."""

STUDIES: dict[str, dict[str, Any]] = {
    "oneshot": {
        "args": ONESHOT_ARGS,
        "runs": {
            f"oneshot-a{alpha}-{kind}": ["--alpha", alpha, *ONESHOT_KINDS[kind]]
            for alpha in ("0.1", "0.5")
            for kind in ONESHOT_KINDS
        },
    },
    "oneshot-letters": {
        "args": [*ONESHOT_ARGS, "--dataset", "emnist-letters"],
        "runs": {
            f"letters-a{alpha}-{kind}": ["--alpha", alpha, *ONESHOT_KINDS[kind]]
            for alpha in ("0.1", "0.5")
            for kind in LETTERS_KINDS
        },
    },
    "hetero": {
        "args": [*FLEET, "--model", "resnet8,lenet5,fedgen_cnn"],
        "runs": {
            "hetero-fedavg": ["--strategy", "fedavg"],
            "hetero-feddf": ["--strategy", "feddf", *_proxy(5000)],
        },
    },
    "mixed": {
        "args": [*FLEET, "--model", "lenet5", "--device-precisions", "fp32,int8,binary", "--qat"],
        "runs": {
            "mixed-fedavg": ["--strategy", "fedavg"],
            "mixed-feddf": ["--strategy", "feddf", *_proxy(5000)],
        },
    },
}

PAPER_ONESHOT = {  # DENSE paper, Table 1, MNIST, 5 clients
    ("0.1", "fedavg"): 48.24,
    ("0.1", "feddf"): 60.15,
    ("0.1", "dense"): 66.61,
    ("0.5", "fedavg"): 90.55,
    ("0.5", "feddf"): 92.18,
    ("0.5", "dense"): 95.82,
}
NAMES = {
    "fedavg": "FedAvg",
    "feddf": "FedDF (proxy)",
    "feddf-gen": "FedDF (generator)",
    "dense": "DENSE",
    "oneshot": "oneshot",
    "oneshot-energy": "oneshot, energy gate only (energy)",
    "oneshot-counts": "oneshot, label counts (counts)",
}


def run_study(args: argparse.Namespace) -> None:
    study = STUDIES[args.study]
    args.out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for run, extra in study["runs"].items():
            if args.only and not any(run.endswith(f"-{name}") for name in args.only):
                continue
            arguments = [*COMMON, *study["args"], *(a.format(data=args.data_dir) for a in extra)]
            arguments += ["--data-dir", str(args.data_dir)]
            run_sim(report_path(args.out, run, seed), seed, arguments)


def _final_acc(report: dict[str, Any], model: str) -> float:
    return float(report["rounds"][-1]["models"][model]["global_acc"])


def _aca_models(report: dict[str, Any]) -> list[str]:
    """The report's ACA model keys: ``aca`` for one group, ``GROUP/aca`` for several,
    and ``aca@FORMAT`` for the ACA as devices of another weight format run it."""
    models = report["rounds"][-1]["models"]
    return sorted(k for k in models if k.split("/")[-1].split("@")[0] == "aca")


def _mb(report: dict[str, Any], key: str) -> float:
    return float(report["final"][key]) / 1e6


def _ensemble_acc(report: dict[str, Any]) -> float | None:
    """The held-out accuracy of the ensemble the server distilled (oneshot reports it)."""
    value = report["rounds"][-1].get("server_metrics", {}).get("ensemble_accuracy")
    return None if value is None else float(value)


def oneshot_table(out: Path, prefix: str = "oneshot", dataset: str = "MNIST") -> None:
    kinds = ONESHOT_KINDS if prefix == "oneshot" else LETTERS_KINDS
    print(f"\n{prefix}: {dataset}, 5 devices, one round; test accuracy of the delivered model, %\n")
    print(
        "| alpha | strategy | this runtime | per seed | its ensemble | seeds | DENSE paper, Table 1 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for alpha in ("0.1", "0.5"):
        for kind in kinds:
            reports = load_reports(out, f"{prefix}-a{alpha}-{kind}")
            accs = [_final_acc(r, "aca") for r in reports]
            ensembles = [e for r in reports if (e := _ensemble_acc(r)) is not None]
            paper = PAPER_ONESHOT.get((alpha, kind), "-") if dataset == "MNIST" else "-"
            shown = spread(accs) if accs else "-"
            seeds = " / ".join(f"{a:.2f}" for a in accs) or "-"
            ceiling = spread(ensembles) if ensembles else "-"
            print(
                f"| {alpha} | {NAMES[kind]} | {shown} | {seeds} | {ceiling} | {len(accs)} "
                f"| {paper} |"
            )


def fleet_table(out: Path, study: str, title: str) -> None:
    runs = list(STUDIES[study]["runs"])
    reports = {run: load_reports(out, run) for run in runs}
    if not all(reports.values()):
        print(f"{study}: missing reports in {out}, skipped", file=sys.stderr)
        return
    models = _aca_models(reports[runs[0]][0])
    rounds = len(reports[runs[0]][0]["rounds"])
    print(f"\n{study}: {title}; {rounds} rounds; test accuracy of each model, %\n")
    print(f"| run | {' | '.join(models)} | MB up | MB down | wall s |")
    print(f"| --- | {' | '.join('---' for _ in models)} | --- | --- | --- |")
    for run in runs:
        rs = reports[run]
        accs = " | ".join(spread([_final_acc(r, m) for r in rs]) for m in models)
        up = statistics.fmean(_mb(r, "bytes_up") for r in rs)
        down = statistics.fmean(_mb(r, "bytes_down") for r in rs)
        wall = statistics.fmean(float(r["final"]["wall_s"]) for r in rs)
        print(f"| {run} ({len(rs)} seeds) | {accs} | {up:.1f} | {down:.1f} | {wall:.0f} |")


def table(args: argparse.Namespace) -> None:
    oneshot_table(args.out)
    oneshot_table(args.out, "letters", "EMNIST letters")
    fleet_table(args.out, "hetero", "resnet8 + lenet5 + fedgen_cnn, a third of 15 devices each")
    fleet_table(args.out, "mixed", "lenet5 at fp32 + int8 (QAT) + binarized, 15 devices")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a study's emulations")
    run.add_argument("--study", choices=list(STUDIES), required=True)
    run.add_argument("--data-dir", type=Path, required=True)
    run.add_argument("--seeds", type=int, nargs="+", default=[0])
    run.add_argument("--out", type=Path, default=Path("studies"))
    run.add_argument(
        "--only",
        nargs="+",
        metavar="KIND",
        help=(
            "only these runs (the end of their names: fedavg, feddf, feddf-gen, dense, "
            "oneshot, oneshot-energy, oneshot-counts)"
        ),
    )
    show = sub.add_parser("table", help="print the tables from the reports")
    show.add_argument("--out", type=Path, default=Path("studies"))
    args = parser.parse_args()
    if args.command == "run":
        run_study(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
