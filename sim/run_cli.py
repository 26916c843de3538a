"""The ``run`` command of ``python -m sim`` (the default): flags, progress, outputs."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

from coordinator.config import TrainingSettings
from coordinator.strategies import strategy_names
from models import classifier_names
from protocol.tensors import Precision
from sim.datasets import dataset_names
from sim.errors import SimError

__all__ = ["add_run_parser"]

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED = 0, 1


def add_run_parser(sub: Any) -> None:
    """Add the ``run`` command to the subparsers ``sub``."""
    run = sub.add_parser(
        "run",
        help="emulate a fleet: coordinator + N edge clients (the default command)",
        description="Run one coordinator and N edge clients in this process; every message "
        "goes through an MQTT broker (embedded amqtt unless --broker) or, with --transport "
        "inproc, through the in-memory twin with the same byte counts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    run.add_argument("--devices", type=int, default=50, help="emulated devices K (50)")
    run.add_argument("--rounds", type=int, default=10, help="federated rounds (10)")
    run.add_argument("--strategy", choices=strategy_names(), default="fedavg")
    run.add_argument(
        "--downlink",
        choices=["dual", "single"],
        default="dual",
        help="fedkf: send ACA (student) + OCA (teacher), or the ACA alone (FedKF-)",
    )
    run.add_argument(
        "--final-model",
        choices=["aca", "oca"],
        help="the model the run delivers (default: oca where the strategy keeps one)",
    )
    run.add_argument(
        "--sharing",
        choices=["full", "head"],
        default="full",
        help="fedavg / fedgen: devices share the whole model or only the prediction head",
    )
    run.add_argument("--model", choices=classifier_names(), default="lenet5")
    run.add_argument("--dataset", choices=dataset_names(), default="synthetic")
    run.add_argument("--data-dir", type=Path, help="folder with the dataset's files")
    run.add_argument(
        "--class-fraction",
        type=float,
        default=1.0,
        help="keep this share of each class of the train split (FedKF's EMNIST: 0.1)",
    )
    run.add_argument("--alpha", type=float, default=0.5, help="Dirichlet alpha; inf = IID (0.5)")
    run.add_argument("--participation", type=float, default=0.2, help="fraction C per round")
    defaults = TrainingSettings()
    run.add_argument("--local-epochs", type=int, help="epochs E (the strategy's default)")
    run.add_argument("--local-steps", type=int, help="local mini-batches instead of epochs")
    run.add_argument("--batch-size", type=int, help="batch size B (the strategy's default)")
    run.add_argument("--lr", type=float, default=defaults.lr, help="local SGD learning rate")
    run.add_argument("--momentum", type=float, default=defaults.momentum, help="SGD momentum")
    run.add_argument("--mu", type=float, default=defaults.mu, help="FedProx mu")
    run.add_argument("--gamma", type=float, default=defaults.gamma, help="fedkf: KD weight")
    run.add_argument(
        "--lambda1", type=float, default=defaults.lambda1, help="fedkf: generator L_OH weight"
    )
    run.add_argument(
        "--lambda2", type=float, default=defaults.lambda2, help="fedkf: generator L_A weight"
    )
    add_precision_args(run)
    run.add_argument(
        "--device-precisions",
        metavar="LIST",
        help="comma-separated precisions the devices ask for, round robin (int8,int4/int8,"
        "fp32 ...; DOWN/UP per direction); default: all take the fleet's",
    )
    run.add_argument(
        "--no-downlink-deltas",
        action="store_true",
        help="always send full models (no deltas against the model a device holds)",
    )
    run.add_argument(
        "--teacher-budget",
        type=float,
        default=0.25,
        help="fedkf dual: teacher delta bytes as a fraction of the model's",
    )
    run.add_argument(
        "--qat", action="store_true", help="int8 devices train with fake-quantized weights"
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--transport", choices=["mqtt", "inproc"], default="mqtt")
    run.add_argument("--broker", metavar="URL", help="external broker for --transport mqtt")
    run.add_argument("--round-timeout", type=float, default=600.0, help="seconds per round")
    run.add_argument("--train-slots", type=int, help="concurrent trainings (CPU count)")
    run.add_argument("--state-dir", type=Path, help="keep coordinator/device state here")
    run.add_argument("--json-out", type=Path, help="write the run's JSON report here")
    run.add_argument("--report-dir", type=Path, help="write rounds.csv and PNG plots here")
    run.add_argument("--save-models", type=Path, help="save the final models (.pt/.onnx) here")
    run.set_defaults(handler=run_from_args)


def add_precision_args(parser: argparse.ArgumentParser) -> None:
    """``--precision``, ``--downlink-precision`` and ``--uplink-precision``."""
    names = [p.value for p in Precision]
    parser.add_argument(
        "--precision", choices=names, default="fp32", help="transfer precision both ways"
    )
    parser.add_argument(
        "--downlink-precision", choices=names, help="models to devices (default: --precision)"
    )
    parser.add_argument(
        "--uplink-precision", choices=names, help="updates to the coordinator (--precision)"
    )


def precision_settings(args: argparse.Namespace) -> dict[str, str]:
    """The fleet's downlink and uplink precisions from :func:`add_precision_args` flags."""
    return {
        "downlink_precision": args.downlink_precision or args.precision,
        "uplink_precision": args.uplink_precision or args.precision,
    }


def run_from_args(args: argparse.Namespace) -> int:
    """Handler of ``python -m sim run``."""
    import torch
    from pydantic import ValidationError

    from protocol.errors import BrokerError, TransportError
    from sim.report import ProgressBar, human_bytes, write_csv, write_plots
    from sim.run import SimConfig, run_simulation

    if args.transport == "inproc" and args.broker:
        raise SimError("--broker needs --transport mqtt")
    if args.report_dir is not None:
        _require_matplotlib()
    settings: dict[str, Any] = {
        "devices": args.devices,
        "rounds": args.rounds,
        "strategy": args.strategy,
        "downlink": args.downlink,
        "final_model": args.final_model,
        "sharing": args.sharing,
        "class_fraction": args.class_fraction,
        "model": args.model,
        "dataset": args.dataset,
        "data_dir": args.data_dir,
        "alpha": math.inf if math.isinf(args.alpha) else args.alpha,
        "participation": args.participation,
        "seed": args.seed,
        "transport": args.transport,
        "broker_url": args.broker,
        "round_timeout_s": args.round_timeout,
        "state_dir": args.state_dir,
        **precision_settings(args),
        "device_precisions": tuple(
            t.strip() for t in (args.device_precisions or "").split(",") if t.strip()
        ),
        "downlink_deltas": not args.no_downlink_deltas,
        "teacher_budget": args.teacher_budget,
    }
    if args.train_slots is not None:
        settings["train_slots"] = args.train_slots
    try:
        settings["training"] = TrainingSettings(
            local_epochs=args.local_epochs,
            local_steps=args.local_steps,
            batch_size=args.batch_size,
            lr=args.lr,
            momentum=args.momentum,
            mu=args.mu,
            gamma=args.gamma,
            lambda1=args.lambda1,
            lambda2=args.lambda2,
            qat=args.qat,
        )
        config = SimConfig(**settings)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise SimError(f"invalid settings: {problems}") from exc
    torch.set_num_threads(1)  # one thread per training; --train-slots trainings at once
    print(
        f"{config.devices} devices, {describe(config)} on {config.model}, {config.dataset} "
        f"(alpha={config.alpha}), {config.rounds} rounds, C={config.participation}, "
        f"transport {config.transport}",
        file=sys.stderr,
    )
    cumulative = [0, 0]
    with ProgressBar(config.rounds) as bar:

        def progress(record: Any) -> None:
            cumulative[0] += record.bytes_up
            cumulative[1] += record.bytes_down
            bar.update(record, cumulative[0], cumulative[1])

        try:
            report = run_simulation(config, on_round=progress, final_models_dir=args.save_models)
        except (TransportError, BrokerError) as exc:
            print(f"python -m sim: error: broker: {exc}", file=sys.stderr)
            return EXIT_FAILED
    final = report.final
    names = ", ".join(
        f"{name} AMP {m['amp']:.2f}%" for name, m in (final.get("models") or {}).items()
    )
    print(
        f"done: {final['rounds']} rounds in {final['wall_s']:.1f} s "
        f"({final['mean_round_wall_s']:.2f} s/round); {names}; up "
        f"{human_bytes(final['bytes_up'])}, down {human_bytes(final['bytes_down'])} "
        f"(wire {human_bytes(final['wire_bytes_up'])} / {human_bytes(final['wire_bytes_down'])}); "
        f"peak RSS {human_bytes(final['peak_rss_bytes'])}",
        file=sys.stderr,
    )
    if args.json_out is not None:
        report.write_json(args.json_out)
        print(f"wrote {args.json_out}", file=sys.stderr)
    if args.report_dir is not None:
        paths = [write_csv(report, args.report_dir), *write_plots(report, args.report_dir)]
        print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return EXIT_OK


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SimError('--report-dir needs matplotlib: pip install "edgefl[report]"') from None


def describe(config: Any, *, compact: bool = False) -> str:
    """The strategy, its mode and the precisions of ``config``, for progress output."""
    if config.strategy == "fedkf":
        name = f"fedkf {config.downlink}" if compact else f"fedkf ({config.downlink} downlink)"
    elif config.sharing == "head":
        name = f"{config.strategy} head" if compact else f"{config.strategy} (head-only sharing)"
    else:
        name = str(config.strategy)
    down, up = config.downlink_precision.value, config.uplink_precision.value
    precision = down if down == up else (f"{down}/{up}" if compact else f"{down} down / {up} up")
    if config.device_precisions:
        asked = ",".join(config.device_precisions)
        precision = asked if compact else f"devices ask {asked}"
    return f"{name} {precision}" if compact else f"{name}, {precision}"
