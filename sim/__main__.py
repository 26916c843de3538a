"""Command line of the lab emulator: ``python -m sim COMMAND ...``.

``python -m sim --help`` (or ``-h``) shows the run command's flags, then the other
commands; ``python -m sim COMMAND --help`` those of one command.

Commands:
    run         (the default when no command is named) emulate a fleet: one coordinator
                and ``--devices`` emulated devices in this process (each with its own id
                and topics, over ``--connections`` broker connections), all messages
                through an MQTT broker (embedded amqtt by default) or the in-memory twin;
                prints a progress line per round and writes ``--json-out`` /
                ``--report-dir``.
    partition   split a dataset across K devices (Dirichlet(alpha) label skew, per-device
                train/test split) and write one ``dev-NNN.npz`` per device plus
                ``summary.json`` into ``--out``.
    devices     emulate only the devices of a keyring file (``--device-keys``) against a
                coordinator run elsewhere (``python -m coordinator --broker URL``), until
                its run finishes; ``--json-out`` writes per round the devices' compute
                seconds (``benchmarks/load.py`` uses it).
    budget      the bytes a configuration moves (per device and round, per round, whole
                run; payload and wire) next to fp32 FedAvg, without running the fleet;
                ``--link`` adds transfer times (see docs/budget.md).

Exit codes: 0 success; 1 an output file could not be written, or the run failed (broker
unreachable: one line, at once; a device or the coordinator failed); 2 bad arguments, a
dataset that cannot be loaded or a partition that cannot be made (one line on stderr);
for ``run``, an output path (``--json-out``, ``--report-dir``, ``--save-models``,
``--state-dir``) that cannot be written is such an argument, found before the run
starts; 130 interrupted (Ctrl-C): ``run`` stops its fleet and writes the report of the
rounds it finished (a second Ctrl-C exits at once), without a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from coordinator.errors import ConfigError
from coordinator.output_paths import check_folder
from sim.budget_cli import add_budget_parser
from sim.datasets import dataset_names, load_dataset
from sim.devices import add_devices_parser
from sim.errors import SimError
from sim.partition import label_counts, mean_label_entropy, partition_dataset, save_device_file
from sim.run import SimConfig
from sim.run_cli import BrokerUnreachableError, add_run_parser
from sim.synthetic import synthetic_size

PROG = "python -m sim"
EXIT_OK, EXIT_IO, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors are one line on stderr, exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m sim`` with all its subcommands."""
    parser = _Parser(prog=PROG, description="Lab emulator of the edge federated-learning runtime.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    run = add_run_parser(sub)
    run.formatter_class = argparse.RawDescriptionHelpFormatter  # keeps the epilog's lines
    run.description = textwrap.fill(run.description or "", width=79)
    run.epilog = OTHER_COMMANDS

    part = sub.add_parser(
        "partition",
        help="split a dataset into per-device files",
        description="Partition a dataset across devices with Dirichlet(alpha) label skew and "
        "a per-device train/test split; write dev-NNN.npz files and summary.json.",
    )
    part.add_argument("--dataset", required=True, choices=dataset_names())
    part.add_argument("--data-dir", type=Path, help="folder with the dataset's official files")
    part.add_argument("--download", action="store_true", help="fetch missing files (torchvision)")
    part.add_argument("--devices", type=int, required=True, help="number of devices K")
    alpha = SimConfig.model_fields["alpha"].default  # the run's default, said once
    part.add_argument(
        "--alpha",
        type=float,
        default=alpha,
        help=f"Dirichlet concentration; 'inf' for IID (default {alpha}, as python -m sim)",
    )
    part.add_argument("--out", type=Path, required=True, help="output folder (created)")
    part.add_argument("--seed", type=int, default=0)
    part.add_argument("--min-samples", type=int, default=10, help="minimum samples per device")
    part.add_argument("--test-fraction", type=float, default=0.2, help="local test share")
    part.set_defaults(handler=_partition_from_args)
    add_budget_parser(sub)
    add_devices_parser(sub)
    return parser


def _partition_from_args(args: argparse.Namespace) -> int:
    # before the dataset loads: a path that cannot be written fails at once, not after it
    check_folder("--out", args.out, ["summary.json"])
    run_partition(
        dataset=args.dataset,
        data_dir=args.data_dir,
        download=args.download,
        num_devices=args.devices,
        alpha=args.alpha,
        out_dir=args.out,
        seed=args.seed,
        min_samples=args.min_samples,
        test_fraction=args.test_fraction,
    )
    return EXIT_OK


def run_partition(
    *,
    dataset: str,
    data_dir: Path | None,
    download: bool,
    num_devices: int,
    alpha: float,
    out_dir: Path,
    seed: int,
    min_samples: int,
    test_fraction: float,
) -> dict[str, Any]:
    """Partition ``dataset`` and write the device files and ``summary.json``; print progress.

    Returns:
        The summary written to ``summary.json`` (alpha is the string ``"inf"`` for IID,
        since JSON has no infinity).

    Raises:
        DatasetError, PartitionError: the dataset cannot be loaded or partitioned.
        OSError: an output file cannot be written.
    """
    start = time.perf_counter()
    options: dict[str, Any] = {"download": True} if download else {}
    if dataset == "synthetic":
        options = synthetic_size(num_devices)
    splits = load_dataset(dataset, data_dir, seed=seed, **options)
    train = splits.train
    print(
        f"loaded {dataset}: {len(train)} train samples, {train.num_classes} classes, "
        f"{train.x.shape[1:]} images ({time.perf_counter() - start:.1f} s)"
    )
    fed = partition_dataset(
        splits,
        num_devices,
        alpha,
        seed=seed,
        min_samples=min_samples,
        test_fraction=test_fraction,
        in_place=True,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    written = set()
    for dev in fed.devices:
        path = out_dir / f"{dev.device_id}.npz"
        save_device_file(path, dev)
        written.add(path.name)
        present = int((dev.train.label_counts() > 0).sum())
        print(
            f"wrote {path}: {len(dev.train)} train / {len(dev.test)} test, "
            f"{present} classes present"
        )
    stale = sorted(p.name for p in out_dir.glob("dev-*.npz") if p.name not in written)
    if stale:
        print(
            f"warning: {out_dir} also holds {len(stale)} older device files "
            f"({stale[0]} ...) not from this run",
            file=sys.stderr,
        )

    entropy = mean_label_entropy(fed)
    summary: dict[str, Any] = {
        "dataset": dataset,
        "alpha": "inf" if math.isinf(alpha) else alpha,
        "seed": seed,
        "num_devices": num_devices,
        "min_samples": min_samples,
        "test_fraction": test_fraction,
        "num_classes": fed.num_classes,
        "global_test_size": None if fed.test is None else len(fed.test),
        "mean_label_entropy_nats": entropy,
        "devices": [
            {
                "device_id": c.device_id,
                "file": f"{c.device_id}.npz",
                "train_size": sum(c.train),
                "test_size": sum(c.test),
                "train_label_counts": c.train,
                "test_label_counts": c.test,
            }
            for c in label_counts(fed)
        ],
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    sizes = np.array([len(d.train) for d in fed.devices])
    print(
        f"{num_devices} devices, alpha={alpha}: train sizes min {sizes.min()} / median "
        f"{int(np.median(sizes))} / max {sizes.max()}; mean label entropy {entropy:.3f} nats "
        f"(uniform: {math.log(fed.num_classes):.3f}); wrote {out_dir / 'summary.json'} "
        f"({time.perf_counter() - start:.1f} s)"
    )
    return summary


COMMANDS = ("run", "partition", "budget", "devices")
OTHER_COMMANDS = f"""other commands ({PROG} COMMAND --help for their flags):
  partition   split a dataset into per-device files (Dirichlet(alpha) label skew)
  budget      bytes per device and round of a configuration, next to fp32 FedAvg
  devices     only the devices of a keyring file, for a coordinator run elsewhere"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    tokens = list(sys.argv[1:] if argv is None else argv)
    if not any(t in COMMANDS for t in tokens):
        tokens.insert(0, "run")  # the emulation is the default command, --help shows its flags
    args = parser.parse_args(tokens)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except BrokerUnreachableError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_IO
    except (SimError, ConfigError) as exc:  # ConfigError: coordinator.output_paths' checks
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_IO
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
