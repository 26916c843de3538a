"""Command line of the coordinator: ``python -m coordinator [flags]``.

Runs a federated job for one fleet over an MQTT broker (``--broker mqtt://host:port``) or
an embedded one (``--embedded-broker``), persisting its state in ``--state-dir`` so that
``--resume`` continues after a crash. ``--config FILE.toml`` gives the same settings as a
file (top-level keys as the flags with ``_`` for ``-``, plus ``[training]`` and
``[broker]`` tables); flags given on the command line win over the file.

Exit codes:
    0   the run finished; final models are in STATE_DIR/final
    1   runtime failure: broker unreachable, state store failure
    2   usage error: bad flags or config file, state directory of another run
    130 interrupted (SIGINT/SIGTERM); the state is consistent, resume with --resume
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

from coordinator.config import CoordinatorConfig, build_config, load_config
from coordinator.errors import ConfigError, CoordinatorError, StateMismatchError
from coordinator.strategies import strategy_names
from protocol.tensors import Precision

PROG = "python -m coordinator"
EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

log = logging.getLogger("coordinator")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; every flag defaults to None so the config file can fill it."""
    p = _Parser(prog=PROG, description="Coordinator of the edge federated-learning runtime.")
    p.add_argument("--config", type=Path, help="TOML file with the same settings")
    broker = p.add_mutually_exclusive_group()
    broker.add_argument("--broker", metavar="URL", help="mqtt://host:port or mqtts://host:port")
    broker.add_argument(
        "--embedded-broker",
        action="store_true",
        default=None,
        help="start an in-process MQTT broker (amqtt) on --embedded-port",
    )
    p.add_argument("--embedded-port", type=int, help="port of the embedded broker (1883)")
    p.add_argument("--fleet", help="fleet name: topics live under fl/FLEET/ (default)")
    p.add_argument("--strategy", choices=strategy_names(), help="algorithm (fedavg)")
    p.add_argument(
        "--downlink", choices=["dual", "single"], help="fedkf: ACA + OCA, or ACA alone (dual)"
    )
    p.add_argument(
        "--final-model", choices=["aca", "oca"], help="model the run delivers (oca where kept)"
    )
    p.add_argument(
        "--sharing", choices=["full", "head"], help="fedavg/fedgen: whole model or head only (full)"
    )
    precisions = [x.value for x in Precision]
    p.add_argument("--precision", choices=precisions, help="transfer precision both ways (fp32)")
    p.add_argument(
        "--downlink-precision", choices=precisions, help="models to devices (--precision)"
    )
    p.add_argument("--uplink-precision", choices=precisions, help="updates (--precision)")
    p.add_argument(
        "--no-downlink-deltas",
        action="store_true",
        default=None,
        help="always send full models (no deltas against the model a device holds)",
    )
    p.add_argument(
        "--teacher-budget",
        type=float,
        help="fedkf dual: teacher delta bytes as a fraction of the model's (0.25)",
    )
    p.add_argument(
        "--qat",
        action="store_true",
        default=None,
        help="int8 devices train with fake-quantized weights",
    )
    p.add_argument("--model", help="classifier registry name (lenet5)")
    p.add_argument("--num-classes", type=int, help="classes of the model (10)")
    p.add_argument("--in-channels", type=int, help="input channels (1)")
    p.add_argument("--image-size", type=int, help="input side in pixels (28)")
    p.add_argument("--rounds", type=int, help="rounds to run (10)")
    p.add_argument("--participation", type=float, help="fraction C of registered devices (0.2)")
    p.add_argument("--min-devices", type=int, help="online devices needed to start a round (1)")
    p.add_argument("--round-timeout", type=float, help="seconds devices have per round (600)")
    p.add_argument("--seed", type=int, help="seed of init, selection and device seeds (0)")
    p.add_argument("--local-epochs", type=int, help="local epochs (strategy's default)")
    p.add_argument("--local-steps", type=int, help="local mini-batches instead of epochs")
    p.add_argument("--batch-size", type=int, help="local batch size (strategy's default)")
    p.add_argument("--lr", type=float, help="local SGD learning rate (0.01)")
    p.add_argument("--momentum", type=float, help="local SGD momentum (0.9)")
    p.add_argument("--mu", type=float, help="FedProx proximal weight (0.01)")
    p.add_argument("--gamma", type=float, help="fedkf: distillation weight (1.0)")
    p.add_argument("--lambda1", type=float, help="fedkf: generator one-hot weight (0.1)")
    p.add_argument("--lambda2", type=float, help="fedkf: generator activation weight (0.1)")
    p.add_argument("--state-dir", type=Path, help="persistent state and final models")
    p.add_argument("--resume", action="store_true", default=None, help="continue a crashed run")
    p.add_argument("--no-onnx", action="store_true", default=None, help="skip the .onnx export")
    p.add_argument(
        "--broadcast-model",
        action="store_true",
        default=None,
        help="after each round publish the final model on fl/FLEET/broadcast/model for "
        "devices that serve it (python -m edge_client follow / --serve-onnx)",
    )
    p.add_argument("--username", help="MQTT user name")
    p.add_argument("--password-file", type=Path, help="file holding the MQTT password")
    p.add_argument("--tls-ca", type=Path, help="CA bundle (enables TLS)")
    p.add_argument("--tls-cert", type=Path, help="client certificate")
    p.add_argument("--tls-key", type=Path, help="client certificate's key")
    p.add_argument("--tls-insecure", action="store_true", default=None, help="no host check")
    p.add_argument("--mqtt-version", choices=["3.1.1", "5"], help="MQTT version (3.1.1)")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


_TOP = {
    "fleet": "fleet",
    "strategy": "strategy",
    "downlink": "downlink",
    "final_model": "final_model",
    "sharing": "sharing",
    "model": "model",
    "num_classes": "num_classes",
    "in_channels": "in_channels",
    "image_size": "image_size",
    "rounds": "rounds",
    "participation": "participation",
    "min_devices": "min_devices",
    "round_timeout": "round_timeout_s",
    "seed": "seed",
    "state_dir": "state_dir",
    "resume": "resume",
    "downlink_precision": "downlink_precision",
    "uplink_precision": "uplink_precision",
    "teacher_budget": "teacher_budget",
    "broadcast_model": "broadcast_model",
}
_TRAINING = (
    "local_epochs",
    "local_steps",
    "batch_size",
    "lr",
    "momentum",
    "mu",
    "gamma",
    "lambda1",
    "lambda2",
    "qat",
)
_BROKER = {
    "broker": "url",
    "embedded_broker": "embedded",
    "embedded_port": "embedded_port",
    "username": "username",
    "password_file": "password_file",
    "tls_ca": "tls_ca",
    "tls_cert": "tls_cert",
    "tls_key": "tls_key",
    "tls_insecure": "tls_insecure",
    "mqtt_version": "mqtt_version",
}


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    """The run's configuration: the TOML file (if any) overridden by the given flags.

    Raises:
        ConfigError: invalid file or settings.
    """
    given = {k: v for k, v in vars(args).items() if v is not None}
    overrides: dict[str, Any] = {
        field: given[flag] for flag, field in _TOP.items() if flag in given
    }
    training = {k: given[k] for k in _TRAINING if k in given}
    broker = {field: given[flag] for flag, field in _BROKER.items() if flag in given}
    if "embedded" in broker:
        broker["url"] = None
    elif "url" in broker:
        broker["embedded"] = False
    if training:
        overrides["training"] = training
    if broker:
        overrides["broker"] = broker
    if args.no_onnx:
        overrides["export_onnx"] = False
    if args.no_downlink_deltas:
        overrides["downlink_deltas"] = False
    if args.precision is not None:
        for field in ("downlink_precision", "uplink_precision"):
            overrides.setdefault(field, args.precision)
    if args.config is not None:
        config = load_config(args.config, overrides)
    else:
        config = build_config({}, overrides)
    if config.broker is None:
        raise ConfigError("give --broker URL or --embedded-broker (or a [broker] table)")
    return config


def run(config: CoordinatorConfig) -> int:
    """Run the job described by ``config``; returns the exit code."""
    from coordinator.runtime import Coordinator
    from coordinator.store import FileStore, MemoryStore, Store
    from protocol.errors import BrokerError, TransportError
    from protocol.transport import MqttTransport

    settings = config.broker
    assert settings is not None
    embedded = None
    try:
        store: Store = MemoryStore()
        if config.state_dir is not None:
            store = FileStore(config.state_dir)
            if not config.resume and store.exists("run"):
                raise ConfigError(
                    f"{config.state_dir} holds a run already: pass --resume to continue it, "
                    "or use an empty --state-dir"
                )
        url = settings.url
        if settings.embedded:
            from protocol.transport.broker import EmbeddedBroker

            embedded = EmbeddedBroker(host="127.0.0.1", port=settings.embedded_port).start()
            url = embedded.url
            log.info("embedded broker at %s", url)
        assert url is not None
        transport = MqttTransport(settings.mqtt_config(url, f"edgefl-coordinator-{config.fleet}"))
        coordinator = Coordinator(config, transport, store)
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


def main(argv: Sequence[str] | None = None) -> int:
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
