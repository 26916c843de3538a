"""Command line of the edge client: ``python -m edge_client [<command>] ...``.

Commands:
    run     (the default when the first argument is an option) run a device: connect
            to the broker, announce, train the coordinator's tasks on the local data
            file and upload the updates until stopped (SIGTERM / SIGINT) or, with
            ``--exit-when-finished``, until the coordinator's run is finished::

                python -m edge_client --broker mqtt://127.0.0.1:1883 --fleet f \
                    --device-id dev-000 --data dev-000.npz --state-dir st

    infer   classify images from a ``.npy`` file with an ONNX model; prints one JSON
            object ``{"predictions": [...], "batch": N, "latency_ms": ...}`` to stdout
            and optionally saves the predictions (or logits) as ``.npy``.

Each command imports what it needs when it runs, so ``infer`` never imports torch.
``run`` logs to stderr (INFO; ``-v``: DEBUG) and logs the peak RSS on exit.

Exit codes:
    0   success (``run``: stopped by a signal or because the coordinator finished)
    1   runtime failure: the broker stayed unreachable for ``--connect-retry`` seconds,
        or an unexpected error (logged with its traceback)
    2   usage error, a bad data file / configuration / model name, or (``infer``) the
        model / input could not be read or did not match; one line on stderr, no
        traceback
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_client.errors import EdgeClientError
from protocol.transport.config import PASSWORD_ENV

if TYPE_CHECKING:
    from edge_client.config import ClientConfig
    from edge_client.data import DeviceData

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
COMMANDS = ("run", "infer")

_Handler = Callable[[argparse.Namespace], int]


class _CliError(Exception):
    """A user-facing failure: printed as one line on stderr, exit code 2."""


class _RunError(Exception):
    """A failure at run time: printed as one line on stderr, exit code 1."""


class _Terminated(BaseException):
    """Raised in the main thread by the SIGTERM / SIGINT handler of ``run``."""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m edge_client",
        description="Edge federated-learning client. Without a command, the options "
        "are those of 'run' (python -m edge_client run --help).",
    )
    commands = parser.add_subparsers(dest="command", metavar="<command>")
    _add_run_parser(commands)

    infer = commands.add_parser(
        "infer",
        help="classify images with an ONNX model",
        description="Classify float32 images (N, C, H, W) or one image (C, H, W) "
        "stored as .npy with an ONNX classifier; prints a JSON object.",
    )
    infer.add_argument("--model", required=True, type=Path, help="ONNX model file")
    infer.add_argument("--input", required=True, type=Path, help=".npy file of float32 images")
    infer.add_argument("--output", type=Path, help="save predictions (int64) as .npy here")
    infer.add_argument(
        "--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1)"
    )
    infer.add_argument(
        "--logits", action="store_true", help="save logits (float32) instead of predictions"
    )
    infer.set_defaults(handler=_run_infer)
    return parser


def _add_run_parser(commands: Any) -> None:
    run = commands.add_parser(
        "run",
        help="run a device (the default command)",
        description="Run an edge device: train the coordinator's tasks on a local data "
        "file and upload the updates, until SIGTERM / SIGINT.",
    )
    run.add_argument(
        "--broker",
        default="mqtt://127.0.0.1:1883",
        help="broker URL, mqtt://host[:port] or mqtts://host[:port] (default %(default)s)",
    )
    run.add_argument("--fleet", default="default", help="fleet name (default %(default)s)")
    run.add_argument("--device-id", help="device id (default: the data file's device_id)")
    run.add_argument("--data", required=True, type=Path, help="device data .npz file")
    run.add_argument(
        "--state-dir", type=Path, help="folder for the client state (handled tasks, rounds)"
    )
    run.add_argument(
        "--threads", type=int, default=1, help="torch threads for training (default 1)"
    )
    run.add_argument("--model", default="lenet5", help="classifier name (default lenet5)")
    run.add_argument(
        "--init-seed",
        type=int,
        default=0,
        help="seed of the model's initial weights; use the coordinator's --seed (default 0)",
    )
    precisions = ("fp32", "fp16", "bf16", "int8", "int4")
    run.add_argument(
        "--precision",
        choices=precisions,
        help="ask for this transfer precision both ways (default: the fleet's)",
    )
    run.add_argument(
        "--downlink-precision", choices=precisions, help="models in this precision (--precision)"
    )
    run.add_argument(
        "--uplink-precision", choices=precisions, help="updates in this precision (--precision)"
    )
    run.add_argument(
        "--share-label-counts",
        action="store_true",
        help="consent to send per-class label counts when a task asks (FedGen)",
    )
    run.add_argument(
        "--exit-when-finished",
        action="store_true",
        help="exit when the coordinator's run is finished (not when it stops or crashes)",
    )
    run.add_argument(
        "--connect-retry",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="keep retrying the first connection this long (default 60)",
    )
    run.add_argument("--username", help="MQTT user name")
    run.add_argument(
        "--password-file",
        type=Path,
        help=f"file holding the MQTT password (else the {PASSWORD_ENV} environment variable)",
    )
    run.add_argument("--tls-ca", type=Path, help="CA certificates (PEM) to verify the broker")
    run.add_argument("--tls-cert", type=Path, help="client certificate (PEM)")
    run.add_argument("--tls-key", type=Path, help="private key of --tls-cert (PEM)")
    run.add_argument(
        "--tls-insecure", action="store_true", help="skip the broker host name check (tests only)"
    )
    run.add_argument(
        "--mqtt-version", choices=("3.1.1", "5"), default="3.1.1", help="default 3.1.1"
    )
    run.add_argument("-v", "--verbose", action="store_true", help="debug logging (default: info)")
    run.set_defaults(handler=_run_device)


def _password(args: argparse.Namespace) -> str | None:
    from protocol.transport import read_password

    try:
        password = read_password(args.password_file)
    except OSError as exc:
        raise _CliError(f"cannot read password file {args.password_file}: {exc}") from exc
    return None if password is None else password.get_secret_value()


def _run_device(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(logging.DEBUG if args.verbose else logging.INFO)
    # Lazy: torch and the runtime are loaded only by this command.
    from edge_client.config import ClientConfig
    from edge_client.data import load_device_data
    from protocol.transport import MqttVersion, TlsConfig

    if args.threads < 1:
        raise _CliError(f"--threads must be >= 1, got {args.threads}")
    if args.connect_retry < 0:
        raise _CliError(f"--connect-retry must be >= 0, got {args.connect_retry}")
    tls_given = args.tls_ca or args.tls_cert or args.tls_key or args.tls_insecure
    if tls_given and not str(args.broker).startswith("mqtts://"):
        raise _CliError("--tls-* options need an mqtts:// broker URL")
    for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert)):
        if path is not None and not path.is_file():
            raise _CliError(f"{flag}: no such file {path}")
    if args.tls_key is not None and not args.tls_key.is_file():
        raise _CliError(f"--tls-key: no such file {args.tls_key}")
    try:
        data = load_device_data(args.data)
        tls = None
        if tls_given:
            tls = TlsConfig(
                ca_file=args.tls_ca,
                cert_file=args.tls_cert,
                key_file=args.tls_key,
                insecure=args.tls_insecure,
            )
        config = ClientConfig.from_broker_url(
            args.broker,
            device_id=args.device_id or data.device_id,
            tls=tls,
            username=args.username,
            password=_password(args),
            mqtt_version=MqttVersion(args.mqtt_version),
            fleet=args.fleet,
            model=args.model,
            state_dir=args.state_dir,
            threads=args.threads,
            init_seed=args.init_seed,
            share_label_counts=args.share_label_counts,
            downlink_precision=args.downlink_precision or args.precision,
            uplink_precision=args.uplink_precision or args.precision,
            exit_when_finished=args.exit_when_finished,
            connect_retry_s=args.connect_retry,
        )
    except (EdgeClientError, ValueError) as exc:  # pydantic's ValidationError too
        raise _CliError(str(exc)) from exc
    try:
        return _serve(config, data)
    finally:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        logging.getLogger("edge_client").info("peak RSS %.1f MB", peak / 1024)


def _serve(config: ClientConfig, data: DeviceData) -> int:
    import torch

    from edge_client.errors import ConnectError
    from edge_client.runtime import EdgeClient
    from protocol.transport import MqttTransport

    torch.set_num_threads(config.threads)
    try:
        client = EdgeClient(config, MqttTransport(config.broker), data)
    except EdgeClientError as exc:
        raise _CliError(str(exc)) from exc
    stopping = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise _Terminated(signal.Signals(signum).name)

    previous: dict[signal.Signals, Any] = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
        client.start()
        while not client.wait(0.5):
            pass
    except _Terminated as exc:
        logging.getLogger("edge_client").info("%s received; stopping", exc)
    except ConnectError as exc:
        raise _RunError(str(exc)) from exc
    finally:
        stopping = True
        client.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return EXIT_OK


def _run_infer(args: argparse.Namespace) -> int:
    # Lazy: onnxruntime is loaded only by this command, and torch never is.
    from edge_client.infer import OnnxClassifier

    try:
        x = np.load(args.input, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise _CliError(f"cannot read input {args.input}: {exc}") from exc
    if not isinstance(x, np.ndarray):  # an .npz archive
        x.close()
        raise _CliError(f"input {args.input} is not a single .npy array")
    try:
        classifier = OnnxClassifier(args.model, threads=args.threads)
        start = time.perf_counter()
        logits = classifier.predict_logits(x)
        latency_ms = (time.perf_counter() - start) * 1000.0
    except EdgeClientError as exc:
        raise _CliError(str(exc)) from exc
    predictions = logits.argmax(axis=1).astype(np.int64)
    if args.output is not None:
        try:
            np.save(args.output, logits if args.logits else predictions, allow_pickle=False)
        except OSError as exc:
            raise _CliError(f"cannot write output {args.output}: {exc}") from exc
    result = {
        "predictions": predictions.tolist(),
        "batch": int(predictions.shape[0]),
        "latency_ms": round(latency_ms, 3),
    }
    print(json.dumps(result))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit code (see module docstring)."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments and arguments[0] not in (*COMMANDS, "-h", "--help"):
        arguments.insert(0, "run")  # the default command
    parser = _build_parser()
    args = parser.parse_args(arguments)
    handler: _Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return handler(args)
    except _CliError as exc:
        _print_error(exc)
        return EXIT_USAGE
    except _RunError as exc:
        _print_error(exc)
        return EXIT_FAILURE


def _print_error(exc: Exception) -> None:
    message = " ".join(str(exc).splitlines())
    print(f"error: {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
