"""The ``run`` command of ``python -m sim`` (the default): flags, progress, outputs.

Its flags are those of :class:`~sim.run.SimConfig` (the fleet's settings and their
defaults are the coordinator's, :class:`~coordinator.config.FleetSettings`), built by
:class:`~protocol.flags.ModelFlags`: a flag left out is not given, and the model
fills it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ValidationError

from coordinator.cli_flags import add_fleet_flags, add_training_flags, given_settings
from coordinator.config import FleetSettings, TrainingSettings, settings_problems
from coordinator.errors import ConfigError
from coordinator.output_paths import check_distinct, check_file, check_folder
from coordinator.report import ACCURACY_PLOT, BYTES_PLOT, CSV_NAME, ReportError, RunReport
from protocol.errors import BrokerError, TransportError
from protocol.flags import ModelFlags
from sim.datasets import dataset_names
from sim.errors import SimError
from sim.run import RunInterrupted, SimConfig

__all__ = [
    "add_engine_flags",
    "add_run_parser",
    "broker_unreachable",
    "build_sim_config",
    "check_output_paths",
    "load_sim_config",
    "sim_config",
    "tune_process",
]

log = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130

DESCRIPTION = (
    "Run one coordinator and N emulated devices in this process, each device with its own "
    "id and topics over a pool of --connections broker connections; every message goes "
    "through an MQTT broker (embedded amqtt unless --broker) or, with --transport inproc, "
    "through the in-memory twin with the same byte counts."
)
FLEET_FIELDS = ("devices", *(n for n in FleetSettings.model_fields if n != "training"))
DATA_FIELDS = (
    "dataset",
    "data_dir",
    "samples_per_device",
    "class_fraction",
    "alpha",
    "min_samples",
    "test_fraction",
    "proxy_data",
    "proxy_size",
)
DATA_CHOICES = {"dataset": dataset_names()}
_LIST = {"device_precisions": "LIST"}


class BrokerUnreachableError(SimError):
    """The MQTT broker of the run cannot be reached (exit code 1)."""


def add_run_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``run`` command to the subparsers ``sub``; returns its parser."""
    run: argparse.ArgumentParser = sub.add_parser(
        "run",
        help="emulate a fleet: coordinator + N emulated devices (the default command)",
        description=DESCRIPTION,
    )
    run.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    run.add_argument(
        "--config",
        type=Path,
        metavar="FILE.toml",
        help="TOML file of the settings below (keys: their names with _ for -, a [training] "
        "table; docs/config.md); flags given on the command line win over it",
    )
    flags = ModelFlags()
    run.set_defaults(handler=run_from_args, settings_flags=flags)
    fleet = run.add_argument_group("fleet")
    add_fleet_flags(fleet, flags, SimConfig, include=FLEET_FIELDS)
    flags.add(fleet, SimConfig, include=("device_precisions", "fleet"), metavars=_LIST)
    add_training_flags(run.add_argument_group("training (sent to the devices)"), flags)
    flags.add(
        run.add_argument_group("data"),
        SimConfig,
        include=DATA_FIELDS,
        choices=DATA_CHOICES,
        metavars={"proxy_data": "PATH", "proxy_size": "N", "samples_per_device": "N"},
    )
    flags.add(
        run.add_argument_group("transport"),
        SimConfig,
        include=("transport", "broker_url", "connections", "max_rate"),
        flags={"broker_url": "--broker"},
        metavars={"broker_url": "URL", "connections": "K", "max_rate": "PER_S"},
    )
    add_engine_flags(run, flags)
    flags.add(
        run.add_argument_group(
            "attack emulation (poisoned devices, to measure screening and robust aggregation)"
        ),
        SimConfig,
        include=("poisoned", "poison", "poison_scale"),
        metavars={"poisoned": "FRACTION"},
    )
    flags.add(run.add_argument_group("security"), SimConfig, include=("enrol",))
    flags.add(
        run.add_argument_group("monitoring (docs/metrics.md, docs/dashboard.md)"),
        SimConfig,
        include=("metrics_port", "dashboard", "dashboard_token_file"),
        metavars={
            "metrics_port": "[HOST:]PORT",
            "dashboard": "[HOST:]PORT",
            "dashboard_token_file": "FILE",
        },
    )
    outputs = run.add_argument_group("outputs")
    flags.add(outputs, SimConfig, include=("state_dir",))
    outputs.add_argument("--json-out", type=Path, help="write the run's JSON report here")
    outputs.add_argument("--report-dir", type=Path, help="write rounds.csv and PNG plots here")
    outputs.add_argument(
        "--save-models", type=Path, help="save the final models (.pt and .onnx) here"
    )
    return run


def add_engine_flags(
    parser: argparse.ArgumentParser, flags: ModelFlags, *, engine_help: str | None = None
) -> None:
    """The group of flags saying how the emulated devices train (``run`` and ``budget``;
    ``engine_help``: the budget's own text for ``--engine``)."""
    flags.add(
        parser.add_argument_group("training engine (how the emulated devices train)"),
        SimConfig,
        include=("engine", "device", "max_cohort"),
        metavars={"max_cohort": "N"},
        help=None if engine_help is None else {"engine": engine_help},
    )


SWITCH_INTERVAL_S = 0.0005
"""The GIL switch interval of a sim run (Python's default: 5 ms)."""


def tune_process() -> None:
    """Set this process up for a sim run: one torch thread (trainings run one at a time;
    other cores carry the broker and the wire), and a short GIL switch interval.

    Each message's zstd and HMAC passes release the GIL; a thread that released it waits
    for a busy Python thread to hand it back, up to the switch interval each time. With
    the default 5 ms, three HMACs of a LeNet-5 model frame (0.8 ms of work) took 26 ms
    beside two busy threads on 2 cores; at 0.5 ms, 3 ms.
    """
    import torch

    torch.set_num_threads(1)
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def sim_config(args: argparse.Namespace) -> SimConfig:
    """The run's settings: the flags given, over the ``--config`` file where there is
    one (the others take SimConfig's defaults).

    Raises:
        SimError: an unreadable file, or invalid settings, every problem listed.
    """
    path: Path | None = getattr(args, "config", None)
    if path is None:
        return build_sim_config({}, given_settings(args))
    return load_sim_config(path, given_settings(args))


def load_sim_config(path: Path, overrides: Mapping[str, Any] | None = None) -> SimConfig:
    """A TOML file of :class:`~sim.run.SimConfig`'s fields (a ``[training]`` table for
    the training settings), with ``overrides`` (the flags given) over it.

    Raises:
        SimError: the file cannot be read, is not TOML, or has invalid settings.
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10
        import tomli as tomllib

    try:
        data: dict[str, Any] = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SimError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SimError(f"config file {path} is not valid TOML: {exc}") from exc
    return build_sim_config(data, overrides or {}, source=str(path))


def build_sim_config(
    data: Mapping[str, Any], overrides: Mapping[str, Any], *, source: str = ""
) -> SimConfig:
    """``overrides`` merged into ``data`` (the ``training`` table key by key), validated.

    Raises:
        SimError: invalid settings, every problem listed (a key in the wrong table says
            where it belongs).
    """
    merged = dict(data)
    for key, value in overrides.items():
        if key == "training" and isinstance(value, Mapping):
            merged[key] = {**dict(merged.get(key) or {}), **value}
        else:
            merged[key] = value
    try:
        return SimConfig.model_validate(merged)
    except ValidationError as exc:
        problems = settings_problems(exc, SimConfig, {"training": TrainingSettings})
        where = f" in {source}" if source else ""
        raise SimError(f"invalid settings{where}: {problems}") from exc


def broker_unreachable(url: str, timeout_s: float = 5.0) -> str | None:
    """Why the broker at ``url`` cannot be reached over TCP (None: it can).

    A cheap check made before the fleet starts, so that a refused or unknown broker ends
    the run at once instead of after every device's connection retries.

    Raises:
        SimError: ``url`` is not an MQTT broker URL.
    """
    from protocol.transport import MqttConfig

    try:
        config = MqttConfig.from_url(url, client_id="edgefl-sim-check")
    except (ValueError, TransportError) as exc:
        raise SimError(f"invalid --broker {url!r}: {exc}") from exc
    where = f"{config.host}:{config.port}"
    try:
        with socket.create_connection((config.host, config.port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"cannot reach the MQTT broker at {where}: no answer within {timeout_s:g} s"
    except socket.gaierror as exc:
        return f"cannot reach the MQTT broker at {where}: unknown host ({exc.strerror})"
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        return f"cannot reach the MQTT broker at {where}: {reason}"


EMBEDDED_BROKER_DEVICES = 2000
"""Fleets above this size get a note that the embedded broker is slow for them."""


def embedded_broker_note(config: SimConfig) -> str | None:
    """A note for a large fleet on the embedded broker, else None.

    amqtt checks every message against every subscription (each device has its own), so
    each message costs O(devices) and a round O(devices^2); Mosquitto's topic tree and
    the in-process twin's do not (docs/fleet.md).
    """
    if config.transport != "mqtt" or config.broker_url is not None:
        return None
    if config.devices <= EMBEDDED_BROKER_DEVICES:
        return None
    return (
        f"note: the embedded broker (amqtt) checks each message against all {config.devices} "
        "devices' subscriptions, so joining and every round slow down with the fleet's "
        "square; for thousands of devices use a real broker (--broker mqtt://HOST:PORT, "
        "e.g. Mosquitto) or --transport inproc (docs/fleet.md)"
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Handler of ``python -m sim run``."""
    from coordinator.report import human_bytes
    from edge_client.errors import ConnectError
    from sim.progress import TerminalProgress
    from sim.run import run_simulation

    config = sim_config(args)
    if config.transport == "inproc" and config.broker_url:
        raise SimError("--broker needs --transport mqtt")
    check_output_paths(args, config)
    if args.report_dir is not None:
        _require_matplotlib()
    if config.transport == "mqtt" and config.broker_url is not None:
        problem = broker_unreachable(config.broker_url)
        if problem is not None:
            raise BrokerUnreachableError(problem)
    tune_process()
    print(
        f"{config.devices} devices, {describe(config)} on {config.model}, {config.dataset} "
        f"(alpha={config.alpha}), {config.rounds} rounds, C={config.participation}, "
        f"transport {config.transport}",
        file=sys.stderr,
    )
    note = embedded_broker_note(config)
    if note is not None:
        print(note, file=sys.stderr)
    with _second_interrupt_exits(), TerminalProgress(config.rounds) as progress:
        try:
            report = run_simulation(config, progress=progress, final_models_dir=args.save_models)
        except (TransportError, BrokerError, ConnectError) as exc:
            raise BrokerUnreachableError(f"MQTT broker: {exc}") from exc
        except RunInterrupted as interrupted:
            report = interrupted.report
        except KeyboardInterrupt:  # before the coordinator started, or as the run ended
            progress.close()
            when = "before the first round" if progress.rounds_closed == 0 else "as the run ended"
            print(f"interrupted {when}; no report written", file=sys.stderr)
            return EXIT_INTERRUPTED
    if report.final.get("interrupted"):
        return _write_interrupted(args, report)
    final = report.final
    if "rank" in final:  # another rank of a sharded run: rank 0 reports for the fleet
        print(
            f"rank {final['rank']}: {final['devices']} devices done in {final['wall_s']:.1f} s",
            file=sys.stderr,
        )
        return EXIT_OK
    names = ", ".join(
        f"{name} AMP {m['amp']:.2f}%" for name, m in (final.get("models") or {}).items()
    )
    print(
        f"done: {final['rounds']} rounds in {final['wall_s']:.1f} s "
        f"({final['mean_round_wall_s']:.2f} s/round); {names}; up "
        f"{human_bytes(final['bytes_up'])}, down {human_bytes(final['bytes_down'])} "
        f"(wire {human_bytes(final['wire_bytes_up'])} / {human_bytes(final['wire_bytes_down'])}); "
        f"peak RSS {human_bytes(final['peak_rss_bytes'])}"
        + (f", peak GPU {human_bytes(final['peak_gpu_bytes'])}" if final["peak_gpu_bytes"] else ""),
        file=sys.stderr,
    )
    _write_outputs(args, report)
    return EXIT_OK


def _write_outputs(args: argparse.Namespace, report: RunReport) -> None:
    """Write ``--json-out`` and ``--report-dir`` (where given) and say so on stderr.

    Raises:
        SimError: a file cannot be written (:class:`~coordinator.report.ReportError`).
    """
    from coordinator.report import write_csv, write_plots

    try:
        if args.json_out is not None:
            report.write_json(args.json_out)
            print(f"wrote {args.json_out}", file=sys.stderr)
        if args.report_dir is not None:
            paths = [write_csv(report, args.report_dir), *write_plots(report, args.report_dir)]
            print(f"wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    except ReportError as exc:
        raise SimError(str(exc)) from exc


def _write_interrupted(args: argparse.Namespace, report: RunReport) -> int:
    """A run stopped by Ctrl-C: one line, then the report of its finished rounds (none
    when no round finished: an empty report would replace an earlier run's); exit 130."""
    done = len(report.rounds)
    rounds = f"{done} round{'' if done == 1 else 's'}"
    if args.json_out is None and args.report_dir is None:
        print(f"interrupted after {rounds}", file=sys.stderr)
    elif done == 0:
        print(f"interrupted after {rounds}; no report written", file=sys.stderr)
    else:
        print(
            f"interrupted after {rounds}; writing the report of the finished rounds",
            file=sys.stderr,
        )
        _write_outputs(args, report)
    return EXIT_INTERRUPTED


def check_output_paths(args: argparse.Namespace, config: SimConfig) -> None:
    """Every output path of the run can be written (:mod:`coordinator.output_paths`),
    checked before the run starts: a run writes its report only when it ends.

    Raises:
        SimError: one line naming the flag, the path and what is wrong.
    """
    outputs: list[tuple[str, Path | None]] = [
        ("--json-out", args.json_out),
        ("--report-dir", args.report_dir),
        ("--save-models", args.save_models),
        ("--state-dir", config.state_dir),
    ]
    try:
        check_distinct(outputs)
        if args.json_out is not None:
            check_file("--json-out", args.json_out)
        if args.report_dir is not None:
            check_folder("--report-dir", args.report_dir, (CSV_NAME, ACCURACY_PLOT, BYTES_PLOT))
        if args.save_models is not None:
            check_folder("--save-models", args.save_models)
        if config.state_dir is not None:
            check_folder("--state-dir", config.state_dir)
    except ConfigError as exc:
        raise SimError(str(exc)) from exc


@contextlib.contextmanager
def _second_interrupt_exits() -> Iterator[None]:
    """The first Ctrl-C is a KeyboardInterrupt (the run stops and reports the rounds it
    finished); a second one, while it stops, ends the process at once (exit 130, nothing
    written). Only where Ctrl-C is Python's default (not ignored, not handled elsewhere)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return

    def again(_signum: int, _frame: FrameType | None) -> None:
        os.write(2, b"interrupted again: exiting without writing the report\n")
        os._exit(EXIT_INTERRUPTED)

    def first(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, again)
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, first)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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
