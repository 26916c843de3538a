"""Command line of the coordinator: ``python -m coordinator [flags]``.

Runs a federated job for one fleet over an MQTT broker (``--broker mqtt://host:port``) or
an embedded one (``--embedded-broker``), persisting its state in ``--state-dir`` so that
``--resume`` continues after a crash (a state directory without a saved run gets a
warning, "no saved run in DIR: starting a fresh run", and a fresh run: a supervisor
restarts with the same flags as the first start). ``--config FILE.toml`` gives the same
settings as a file (top-level keys as the flags with ``_`` for ``-``, plus ``[training]``
and ``[broker]`` tables); flags given on the command line win over the file. Every flag
is derived from :class:`~coordinator.config.CoordinatorConfig`
(:mod:`coordinator.cli_flags`, :mod:`protocol.flags`): its defaults are the model's.

``python -m coordinator revoke --state-dir DIR ID [ID ...]`` revokes devices: their ids go
to DIR/revoked-devices.json, and a running coordinator of that state dir refuses them
within a second (one started later, from its start): their enrolled keys are dropped,
and neither the fleet token nor --device-keys lets them back in (docs/protocol.md,
section 2.4).

Exit codes:
    0   the run finished (revoke: the ids are recorded); final models are in STATE_DIR/final
    1   runtime failure: broker unreachable, state store failure, a failed aggregation
    2   usage error: bad flags or config file, state directory of another run
    130 interrupted (SIGINT/SIGTERM); the state is consistent, resume with --resume

With ``--state-dir``, STATE_DIR/status.json holds the run's phase, every round's start
and close and, once the process has exited, its peak RSS
(:class:`~coordinator.runtime.RunStatus`). ``--json-out FILE`` and ``--report-dir DIR``
write the run report when it ends (docs/report.md; stopped: its finished rounds), and
``--eval-data FILE.npz`` evaluates every round's global models on held-out data
(:mod:`coordinator.recording`); their paths are checked before the run starts.
"""

from __future__ import annotations

import argparse
import logging
import resource
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

from coordinator.cli_flags import add_fleet_flags, add_training_flags, given_settings
from coordinator.config import (
    BrokerSettings,
    CoordinatorConfig,
    FleetSettings,
    build_config,
    load_config,
)
from coordinator.errors import ConfigError, CoordinatorError, StateMismatchError
from protocol.flags import ModelFlags

PROG = "python -m coordinator"
EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

log = logging.getLogger("coordinator")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: one flag per setting of :class:`CoordinatorConfig`.

    Flags default to "not given" so that the config file, then the settings' own
    defaults, fill what the command line leaves out (:func:`config_from_args`).
    """
    p = _Parser(
        prog=PROG,
        description="Coordinator of the edge federated-learning runtime.",
        epilog=f"Revoke devices: {PROG} revoke --state-dir DIR ID [ID ...].",
    )
    p.add_argument("--config", type=Path, help="TOML file with the same settings")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    flags = ModelFlags()
    p.set_defaults(settings_flags=flags)
    broker = p.add_argument_group("broker")
    where = broker.add_mutually_exclusive_group()
    flags.add(where, BrokerSettings, include=("url", "embedded"), path=("broker",), **_BROKER)
    flags.add(broker, BrokerSettings, exclude=("url", "embedded", "password"), path=("broker",))
    flags.add(
        broker,
        CoordinatorConfig,
        include=("connect_retry_s",),
        flags={"connect_retry_s": "--connect-retry"},
        metavars={"connect_retry_s": "S"},
    )
    fleet = p.add_argument_group("fleet")
    flags.add(fleet, CoordinatorConfig, include=("fleet", "coordinator_id", "min_devices"))
    add_fleet_flags(fleet, flags, FleetSettings, exclude=("training",))
    flags.add(
        p.add_argument_group("model shape"),
        CoordinatorConfig,
        include=("num_classes", "in_channels", "image_size", "input_shape"),
        metavars={"input_shape": "D1,D2,..."},
    )
    add_training_flags(p.add_argument_group("training (sent to the devices)"), flags)
    flags.add(
        p.add_argument_group("server"),
        CoordinatorConfig,
        include=("server_device", "proxy_data", "proxy_size"),
        metavars={"proxy_data": "PATH", "proxy_size": "N"},
    )
    flags.add(
        p.add_argument_group("security"),
        CoordinatorConfig,
        include=(
            "device_keys",
            "fleet_token_file",
            "max_enrolled",
            "signing_key_file",
            "insecure_no_auth",
            "replay_window_s",
        ),
        metavars={
            "device_keys": "FILE",
            "fleet_token_file": "FILE",
            "max_enrolled": "N",
            "signing_key_file": "FILE",
        },
    )
    flags.add(
        p.add_argument_group("monitoring (docs/metrics.md, docs/dashboard.md)"),
        CoordinatorConfig,
        include=("metrics_port", "dashboard", "dashboard_token_file"),
        metavars=_MONITOR_METAVARS,
    )
    flags.add(
        p.add_argument_group("state and outputs"),
        CoordinatorConfig,
        include=(
            "state_dir",
            "resume",
            "export_onnx",
            "broadcast_model",
            "json_out",
            "report_dir",
            "eval_data",
        ),
        flags={"export_onnx": "--onnx"},
        metavars={"json_out": "FILE", "report_dir": "DIR", "eval_data": "FILE.npz"},
    )
    return p


EMBEDDED_PORT_HINT = (
    "pass --embedded-port 0 for a free one (its URL is logged at start), or "
    "--broker mqtt://HOST:PORT to use that broker"
)
"""What to do when the embedded broker's port is taken (an installed Mosquitto on 1883)."""

_MONITOR_METAVARS = {
    "metrics_port": "[HOST:]PORT",
    "dashboard": "[HOST:]PORT",
    "dashboard_token_file": "FILE",
}

_BROKER: dict[str, Any] = {
    "flags": {"url": "--broker", "embedded": "--embedded-broker"},
    "metavars": {"url": "URL"},
}


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    """The run's configuration: the TOML file (if any) overridden by the given flags.

    Raises:
        ConfigError: invalid file or settings.
    """
    overrides = given_settings(args)
    broker = overrides.get("broker", {})
    if broker.get("embedded"):
        broker["url"] = None
    elif "url" in broker:
        broker["embedded"] = False
    if args.config is not None:
        config = load_config(args.config, overrides)
    else:
        config = build_config({}, overrides)
    if config.broker is None:
        raise ConfigError("give --broker URL or --embedded-broker (or a [broker] table)")
    return config


def run(config: CoordinatorConfig) -> int:
    """Run the job described by ``config``; returns the exit code."""
    from coordinator.monitor import monitoring
    from coordinator.proxy import check_proxy_use, read_proxy_data
    from coordinator.recording import check_outputs, recording
    from coordinator.runtime import STATUS_FILE, Coordinator, RunStatus
    from coordinator.store import FileStore, MemoryStore, Store
    from protocol.errors import BrokerError, TransportError
    from protocol.transport import MqttTransport

    settings = config.broker
    assert settings is not None
    embedded = None
    status = None
    try:
        held_out = check_outputs(config)  # the report's paths and data, before anything starts
        store: Store = MemoryStore()
        if config.state_dir is not None:
            store = FileStore(config.state_dir)
            if not config.resume and store.exists("run"):
                raise ConfigError(
                    f"{config.state_dir} holds a run already: pass --resume to continue it, "
                    "or use an empty --state-dir"
                )
            if config.resume and not store.exists("run"):
                # a supervisor restarting with --resume also starts the very first run
                log.warning("no saved run in %s: starting a fresh run", config.state_dir)
        proxy = None
        if config.proxy_data is not None:
            check_proxy_use(config.strategy, config.distill_data)  # before reading them
            proxy = read_proxy_data(config.proxy_data, size=config.proxy_size, seed=config.seed)
        url = settings.url
        if settings.embedded:
            from protocol.transport.broker import EmbeddedBroker, PortInUseError

            try:
                embedded = EmbeddedBroker(host="127.0.0.1", port=settings.embedded_port).start()
            except PortInUseError as exc:
                raise BrokerError(f"{exc}: {EMBEDDED_PORT_HINT}") from exc
            url = embedded.url
            log.info("embedded broker at %s", url)
        assert url is not None
        transport = MqttTransport(settings.mqtt_config(url, f"edgefl-coordinator-{config.fleet}"))
        coordinator = Coordinator(config, transport, store, proxy_data=proxy, held_out=held_out)
        if config.state_dir is not None:
            status = RunStatus(config.state_dir / STATUS_FILE, config, resume=config.resume)
            coordinator.add_observer(status)
        _stop_on_signals(coordinator.stop)
        log.info(
            "fleet %s: %s on %s, %d rounds, C=%.2f; waiting for %d device(s)",
            config.fleet,
            config.strategy,
            config.model,
            config.rounds,
            config.participation,
            config.min_devices,
        )
        with monitoring(coordinator.telemetry, config), recording(coordinator, held_out):
            models = coordinator.run()
    except StateMismatchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CoordinatorError, TransportError, BrokerError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    finally:
        if embedded is not None:
            embedded.stop()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        log.info("peak RSS %.1f MB", peak / 1024)
        if status is not None:
            status.exited(peak / 1024)
    if models is None:
        log.warning("stopped before the last round; resume with --resume")
        return EXIT_INTERRUPTED
    return EXIT_OK


def _stop_on_signals(stop: Any) -> None:
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        log.warning("signal %d: stopping after the current event", signum)
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def revoke_main(argv: Sequence[str]) -> int:
    """``python -m coordinator revoke --state-dir DIR ID [ID ...]``; returns the exit code."""
    from coordinator.enrolment import FleetKeys, revoke

    p = _Parser(
        prog=f"{PROG} revoke",
        description="Revoke devices: the coordinator refuses them from now on (a running "
        "one within a second).",
    )
    p.add_argument("--state-dir", type=Path, required=True, help="the coordinator's state dir")
    p.add_argument("device_ids", nargs="+", metavar="ID", help="device id")
    args = p.parse_args(argv)
    try:
        revoked = revoke(args.state_dir, args.device_ids)
        enrolled = FleetKeys.enrolled_ids(args.state_dir)
    except (OSError, ValueError) as exc:
        print(f"{PROG} revoke: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for device_id in args.device_ids:
        how = "enrolled" if device_id in enrolled else "not enrolled"
        print(f"revoked {device_id} ({how})")
    print(
        f"{len(revoked)} device(s) revoked in {args.state_dir}; a running coordinator "
        "refuses them within a second",
        file=sys.stderr,
    )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["revoke"]:
        return revoke_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
