"""What update screening and robust aggregation cost, and what they save, under poisoning.

Runs ``python -m sim`` (coordinator + emulated devices through the in-memory broker
twin), one configuration at a time, on non-IID MNIST (Dirichlet alpha 0.5, 20 devices,
C = 0.5, LeNet-5, FedAvg) with 0 % and 20 % poisoned devices (``--poisoned``, the sim's
attack emulation, ``sim/poison.py``):

- ``constant``: every weight of the upload set to 3.0 (the attack of issue 17);
- ``sign_flip``: the model received minus 5 x the device's honest delta (an attack of
  ordinary size, which norm screening lets through by design).

Each row is one run: the aggregation (``mean`` = the sample-weighted FedAvg average,
``median`` / ``trimmed_mean`` = unweighted coordinate-wise, trim 0.2), norm screening
on (the default ratio 10) or off (``--max-update-norm-ratio 0``), and what came out: the
global model's accuracy on the MNIST test set after the last round (the report's
``global_acc``), updates rejected, and the mean wall time of a round.

Run from the repository root (MNIST's files in DATA_DIR/mnist)::

    python -m benchmarks.poisoning --data-dir ../shared/data [--quick] [--rounds 10]
        [--local-epochs 1] [--class-fraction 1.0] [--lr LR] [--json]

``--quick``: 3 rounds of 2 local epochs on a fifth of MNIST's train split, for a look
in a few minutes.
Prints a Markdown table (and, with ``--json``, the rows as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple


class Case(NamedTuple):
    poisoned: float
    attack: str
    aggregation: str
    screening: bool


CASES = (
    Case(0.0, "-", "mean", True),
    Case(0.0, "-", "mean", False),
    Case(0.0, "-", "median", True),
    Case(0.0, "-", "trimmed_mean", True),
    Case(0.2, "constant", "mean", False),
    Case(0.2, "constant", "mean", True),
    Case(0.2, "constant", "median", False),
    Case(0.2, "constant", "trimmed_mean", False),
    Case(0.2, "sign_flip", "mean", True),
    Case(0.2, "sign_flip", "median", True),
    Case(0.2, "sign_flip", "trimmed_mean", True),
)
SIGN_FLIP_SCALE = 5.0


def command(case: Case, args: argparse.Namespace, json_out: Path) -> list[str]:
    """The ``python -m sim`` command line of ``case``."""
    line = [
        sys.executable, "-m", "sim", "run",
        "--dataset", "mnist", "--data-dir", str(args.data_dir / "mnist"),
        "--alpha", "0.5", "--devices", "20", "--participation", "0.5",
        "--model", "lenet5", "--strategy", "fedavg", "--rounds", str(args.rounds),
        "--local-epochs", str(args.local_epochs), "--class-fraction", str(args.class_fraction),
        "--transport", "inproc", "--seed", str(args.seed),
        "--aggregation", case.aggregation,
        "--json-out", str(json_out),
    ]  # fmt: skip
    if args.lr is not None:
        line += ["--lr", str(args.lr)]
    if not case.screening:
        line += ["--max-update-norm-ratio", "0"]
    if case.poisoned:
        line += ["--poisoned", str(case.poisoned), "--poison", case.attack]
        if case.attack == "sign_flip":
            line += ["--poison-scale", str(SIGN_FLIP_SCALE)]
    return line


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "report.json"
        started = time.perf_counter()
        done = subprocess.run(
            command(case, args, out),
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        )
        if done.returncode != 0:
            raise RuntimeError(f"{case}: python -m sim failed:\n{done.stderr[-3000:]}")
        final = json.loads(out.read_text())["final"]
    aca = final["models"]["aca"]
    return {
        **case._asdict(),
        "global_acc": aca["global_acc"],
        "amp": aca["amp"],
        "rejected": final["rejected_updates"],
        "poisoned_devices": final["poisoned_devices"],
        "round_s": final["mean_round_wall_s"],
        "run_s": time.perf_counter() - started,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| poisoned | attack | aggregation | screening | global acc % | rejected | s/round |",
        "|---:|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['poisoned']:.0%} | {r['attack']} | {r['aggregation']} | "
            f"{'on' if r['screening'] else 'off'} | {r['global_acc']:.2f} | {r['rejected']} | "
            f"{r['round_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, required=True, help="folder holding mnist/")
    parser.add_argument(
        "--quick", action="store_true", help="3 rounds of 2 epochs on 20%% of the data"
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--class-fraction", type=float, default=1.0)
    parser.add_argument("--lr", type=float, help="local learning rate (default: the sim's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.class_fraction, args.local_epochs = 3, 0.2, 2
    rows = []
    for case in CASES:
        row = run_case(case, args)
        rows.append(row)
        print(
            f"{case}: global acc {row['global_acc']:.2f} %, rejected {row['rejected']}, "
            f"{row['round_s']:.1f} s/round",
            file=sys.stderr,
        )
    print(
        f"non-IID MNIST (alpha 0.5), 20 devices, C=0.5, LeNet-5, FedAvg, {args.rounds} rounds "
        f"of {args.local_epochs} local epoch(s) (lr {args.lr or 'default'}), "
        f"{args.class_fraction:g} of the train split; "
        f"sign_flip scale {SIGN_FLIP_SCALE:g}\n"
    )
    print(table(rows))
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
