"""Command line of the edge client: ``python -m edge_client [<command>] ...``.

Commands:
    run       (the default when the first argument is an option) run a training device:
              connect to the broker, announce, train the coordinator's tasks on the local
              data file and upload the updates until stopped (SIGTERM / SIGINT) or, with
              ``--exit-when-finished``, until the coordinator's run is finished (or it
              refuses the device, or none answers its hello: exit 3 or 4)::

                  python -m edge_client --broker mqtt://127.0.0.1:1883 --fleet f \
                      --device-id dev-000 --data dev-000.npz --state-dir st

    follow    run an inference-only device (no torch): keep ``--serve-onnx`` current with
              the model the coordinator broadcasts after each round (``--broadcast-model``).
    infer     classify images from a ``.npy`` file with an ONNX model; prints one JSON
              object ``{"predictions": [...], "batch": N, "latency_ms": ...}`` to stdout
              and optionally saves the predictions (or logits) as ``.npy``; warns on
              stderr where the model is a template never filled with trained weights.
    template  write the ONNX template (fp32 or int8) a device renders the fleet's model
              into (needs torch and onnx: the ``server`` extra).
    bundle    build an offline install bundle for a board (see edge_client.bundle.builder).

The flags of ``run`` and ``follow`` are derived from
:class:`~edge_client.config.DeviceSettings` (their defaults are its), and both take
``--config FILE.toml``: every flag is a key, flags given on the command line win. Each
command imports what it needs when it runs, so ``follow`` and ``infer`` never import
torch. ``run`` and ``follow`` log to stderr (INFO; ``-v``: DEBUG), in journald's format
under systemd (``--log-format``), and log the peak RSS on exit.

Exit codes:
    0   success (``run`` / ``follow``: stopped by a signal, or the coordinator finished)
    1   runtime failure: the broker stayed unreachable for ``--connect-retry`` seconds,
        a bundle download failed, or an unexpected error (logged with its traceback)
    2   usage error, a bad data file / configuration / model name, not enough memory for
        training, or (``infer``) the model / input could not be read or did not match;
        one line on stderr, no traceback (systemd units do not restart on it)
    3   ``run --exit-when-finished``: the coordinator refused the device's hello (an
        authenticated nack: another model or number of classes, a precision the fleet
        does not run, no consent to share label counts, no training samples); the
        reason and what to do are logged at ERROR
    4   ``run --exit-when-finished``: no coordinator answered the hello within
        ``--hello-timeout`` seconds (default 60): the device key is wrong or not
        registered (the fleet's coordinator was seen up), or the fleet name or the
        broker is wrong (no coordinator status on the fleet); the hint is logged at ERROR
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import numpy as np

from edge_client.config import FOLLOW_KEYS, RUN_KEYS, DeviceSettings, device_settings
from edge_client.errors import ConfigError, EdgeClientError
from protocol.flags import ModelFlags

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
"""The coordinator refused the device's hello (``run --exit-when-finished``)."""
EXIT_UNANSWERED = 4
"""No coordinator answered the device's hello in time (``run --exit-when-finished``)."""
COMMANDS = ("run", "follow", "infer", "template", "bundle")
KEYS = {"run": RUN_KEYS, "follow": FOLLOW_KEYS}
"""The device commands (they take ``--config``) and the settings each takes."""
CONFIGURABLE = tuple(KEYS)
MEMORY_CHECK_BATCH = 64
"""Batch size the start-up memory check assumes: the largest default of the strategies
(FedKF's B = 64); a task's own batch size is what training then uses."""

_Handler = Callable[[argparse.Namespace], int]
_DeviceHandler = Callable[[DeviceSettings], int]


class _CliError(Exception):
    """A user-facing failure: printed as one line on stderr, exit code 2."""


class _RunError(Exception):
    """A failure at run time: printed as one line on stderr, exit code 1."""


class _Terminated(BaseException):
    """Raised in the main thread by the SIGTERM / SIGINT handler of ``run``."""


class _Service(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def wait(self, timeout: float | None = None) -> bool: ...


def _build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="python -m edge_client",
        description="Edge federated-learning client. Without a command, the options "
        "are those of 'run' (python -m edge_client run --help).",
    )
    commands = parser.add_subparsers(dest="command", metavar="<command>")
    subparsers = {
        "run": _add_device_parser(
            commands,
            "run",
            _run_device,
            help="run a training device (the default command)",
            description="Run an edge device: train the coordinator's tasks on a local data "
            "file and upload the updates, until SIGTERM / SIGINT.",
        ),
        "follow": _add_device_parser(
            commands,
            "follow",
            _run_follow,
            help="run an inference-only device: keep a local ONNX model current",
            description="Keep --serve-onnx current with the model the coordinator "
            "broadcasts after each round (coordinator --broadcast-model); trains nothing, "
            "needs no torch.",
        ),
        "infer": _add_infer_parser(commands),
        "template": _add_template_parser(commands),
        "bundle": _add_bundle_parser(commands),
    }
    return parser, subparsers


def _add_device_parser(
    commands: Any, name: str, handler: _DeviceHandler, **text: str
) -> argparse.ArgumentParser:
    """The parser of ``run`` or ``follow``: ``--config`` and a flag per key the command
    takes, derived from :class:`DeviceSettings`."""
    command: argparse.ArgumentParser = commands.add_parser(name, **text)
    command.add_argument(
        "--config",
        type=Path,
        help="TOML file of settings: every flag is a key (--device-id: device_id); "
        "flags given here win",
    )
    flags = ModelFlags()
    flags.add(command, DeviceSettings, include=KEYS[name], flags=_FLAGS, metavars=_METAVARS)
    command.set_defaults(settings_flags=flags, device_handler=handler)
    return command


_FLAGS: dict[str, str | tuple[str, ...]] = {"verbose": ("-v", "--verbose")}
_METAVARS = {
    "connect_retry": "SECONDS",
    "hello_timeout": "SECONDS",
    "password_env": "NAME",
    "memory_budget_mb": "MB",
}


def _device_settings(args: argparse.Namespace) -> DeviceSettings:
    """The settings of ``run`` / ``follow``: the flags given over ``--config``'s file.

    Raises:
        ConfigError: the file or a flag holds an invalid setting.
    """
    flags: ModelFlags = args.settings_flags
    return device_settings(flags.given(args), args.config, KEYS[args.command])


def _add_infer_parser(commands: Any) -> argparse.ArgumentParser:
    infer: argparse.ArgumentParser = commands.add_parser(
        "infer",
        help="classify samples with an ONNX model",
        description="Classify float32 samples (N, *sample_shape), images (N, C, H, W), or "
        "one sample stored as .npy with an ONNX classifier; prints a JSON object.",
    )
    infer.add_argument("--model", required=True, type=Path, help="ONNX model file")
    infer.add_argument("--input", required=True, type=Path, help=".npy file of float32 samples")
    infer.add_argument("--output", type=Path, help="save predictions (int64) as .npy here")
    infer.add_argument(
        "--threads", type=int, default=1, help="onnxruntime intra-op threads (default 1)"
    )
    infer.add_argument(
        "--logits", action="store_true", help="save logits (float32) instead of predictions"
    )
    infer.set_defaults(handler=_run_infer)
    return infer


def _add_template_parser(commands: Any) -> argparse.ArgumentParser:
    template: argparse.ArgumentParser = commands.add_parser(
        "template",
        help="write the ONNX template a serving device renders the fleet's model into",
        description="Export the classifier's graph as an ONNX template (fp32, or int8 "
        "with dynamic activation quantization) for --onnx-template. Needs torch and onnx "
        "(pip install 'edgefl[server]'); the device needs neither.",
    )
    template.add_argument("--model", default="lenet5", help="classifier name (default lenet5)")
    template.add_argument("--num-classes", type=int, default=10, help="default 10")
    template.add_argument("--in-channels", type=int, default=1, help="default 1")
    template.add_argument("--image-size", type=int, default=28, help="default 28")
    template.add_argument(
        "--input-shape",
        type=_sample_shape,
        metavar="D1,D2,...",
        help="shape of one sample, for a model of your own on series or feature vectors "
        "(e.g. 6,100); unset: in-channels x image-size x image-size",
    )
    template.add_argument("--precision", choices=("fp32", "int8"), default="fp32")
    template.add_argument("--out", required=True, type=Path, help="template file to write")
    template.set_defaults(handler=_run_template)
    return template


def _add_bundle_parser(commands: Any) -> argparse.ArgumentParser:
    from edge_client.bundle.builder import PLATFORMS, TORCH_INDEXES

    bundle: argparse.ArgumentParser = commands.add_parser(
        "bundle",
        help="build an offline install bundle for a board",
        description="Download the wheels a board needs (pip's cross-platform download), "
        "build the project's wheel and write the config, a systemd unit and install.sh "
        "into --out; install.sh then installs with no network.",
    )
    bundle.add_argument("--out", required=True, type=Path, help="bundle folder (new or empty)")
    bundle.add_argument(
        "--profile",
        choices=("train", "infer"),
        default="train",
        help="train: the training client (torch); infer: onnxruntime only (default train)",
    )
    bundle.add_argument(
        "--platform",
        default="native",
        help=f"target: {', '.join(PLATFORMS)} or native, this machine (default native)",
    )
    bundle.add_argument(
        "--python-version",
        metavar="X.Y",
        help="the board's Python (default: this interpreter's; Raspberry Pi OS 12: 3.11, "
        "JetPack 6: 3.10)",
    )
    bundle.add_argument(
        "--torch-index",
        metavar="URL|NAME",
        help="where torch comes from, required for --profile train: "
        f"{', '.join(f'{k} ({v})' for k, v in TORCH_INDEXES.items())}, "
        "'default' (pip's configured index and find-links), the URL of an index, or "
        "a folder of wheels (a Jetson's torch wheel for its JetPack, downloaded by hand)",
    )
    bundle.add_argument(
        "--torch-version", metavar="VERSION", help="pin torch (default: the newest the index has)"
    )
    bundle.add_argument(
        "--extra-index-url",
        action="append",
        default=[],
        metavar="URL",
        help="another index for the non-torch wheels, repeatable (32-bit Raspberry Pi OS: "
        "https://www.piwheels.org/simple)",
    )
    bundle.add_argument("--config", type=Path, help="device config (TOML) to include")
    bundle.add_argument(
        "--onnx-template", type=Path, help="ONNX template to include (for serve_onnx)"
    )
    bundle.add_argument(
        "--coordinator-key",
        type=Path,
        metavar="FILE",
        help="the coordinator's public signing key to include, installed as "
        "CONFIG_DIR/coordinator.pub (for coordinator_key_file)",
    )
    bundle.add_argument(
        "--memory-max",
        help="systemd MemoryMax of the service (default: 1G train, 256M infer)",
    )
    bundle.add_argument(
        "--cpu-quota", default="300%", help="systemd CPUQuota of the service (default 300%%)"
    )
    bundle.set_defaults(handler=_run_bundle)
    return bundle


def _configure_logging(settings: DeviceSettings) -> None:
    from edge_client.logs import configure_logging

    level = logging.DEBUG if settings.verbose else logging.INFO
    configure_logging(level, fmt=settings.log_format)


def _run_device(settings: DeviceSettings) -> int:
    if settings.data is None:
        raise _CliError("--data (or data in the config file) is required")
    _configure_logging(settings)
    # Lazy: torch and the runtime are loaded only by this command.
    from edge_client.train.data import load_device_data

    try:
        data = load_device_data(settings.data)
    except EdgeClientError as exc:
        raise _CliError(str(exc)) from exc
    config = settings.client_config(settings.device_id or data.device_id)
    import torch

    from edge_client.train.resources import check_memory, estimate_training
    from edge_client.train.runtime import EdgeClient
    from protocol.transport import MqttTransport

    torch.set_num_threads(config.threads)
    try:
        client = EdgeClient(config, MqttTransport(config.broker), data)
        model = client.model
        estimate = estimate_training(model, model.input_shape, MEMORY_CHECK_BATCH)
        megabytes = settings.memory_budget_mb
        budget = None if megabytes is None else int(megabytes * 2**20)
        check_memory(estimate, budget_bytes=budget, what=f"{config.model} training")
    except EdgeClientError as exc:
        raise _CliError(str(exc)) from exc
    logging.getLogger("edge_client").info(
        "memory check passed: %s; %d torch thread(s)", estimate.describe(), config.threads
    )
    _serve(client)
    refusal = client.refusal
    if refusal is None:
        return EXIT_OK
    return EXIT_REFUSED if refusal.kind == "refused" else EXIT_UNANSWERED


def _run_follow(settings: DeviceSettings) -> int:
    if settings.device_id is None:
        raise _CliError("--device-id (or device_id in the config file) is required")
    if settings.serve_onnx is None or settings.onnx_template is None:
        raise _CliError("follow needs --serve-onnx and --onnx-template (or the config keys)")
    _configure_logging(settings)
    from edge_client.serve.follower import Follower, ModelRefresher
    from protocol.transport import MqttTransport

    config = settings.client_config(settings.device_id)
    assert config.serve_onnx is not None and config.onnx_template is not None
    try:
        refresher = ModelRefresher(config.onnx_template, config.serve_onnx)
    except EdgeClientError as exc:
        raise _CliError(str(exc)) from exc
    return _serve(Follower(config, MqttTransport(config.broker), refresher))


def _serve(service: _Service) -> int:
    """Start ``service`` and run until it stops or SIGTERM / SIGINT arrives; log the
    peak RSS on the way out."""
    from edge_client.errors import ConnectError

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
        service.start()
        while not service.wait(0.5):
            pass
    except _Terminated as exc:
        logging.getLogger("edge_client").info("%s received; stopping", exc)
    except ConnectError as exc:
        raise _RunError(str(exc)) from exc
    finally:
        stopping = True
        service.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        from edge_client.link import peak_rss_bytes

        logging.getLogger("edge_client").info("peak RSS %.1f MB", peak_rss_bytes() / 2**20)
    return EXIT_OK


def _sample_shape(text: str) -> tuple[int, ...]:
    """``--input-shape``: ``D1,D2,...``, 1 to 8 positive sizes."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not sizes D1,D2,... (e.g. 6,100)") from None
    if not 1 <= len(shape) <= 8 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 to 8 sizes, each at least 1")
    return shape


def _run_template(args: argparse.Namespace) -> int:
    from edge_client.errors import OnnxTemplateError
    from edge_client.serve.checks import verify_template

    try:
        from models import ModelError, build_classifier, seeded
        from models.onnx_template import export_template
    except ImportError as exc:
        raise _CliError(
            f"template needs torch and onnx ({exc}); pip install 'edgefl[server]'"
        ) from exc
    try:
        with seeded(0):
            model = build_classifier(
                args.model,
                num_classes=args.num_classes,
                in_channels=args.in_channels,
                image_size=args.image_size,
                input_shape=args.input_shape,
            )
        data = export_template(
            model, model.input_shape, precision=args.precision, model_name=args.model
        )
        state = {
            name: tensor.detach().cpu().numpy()
            for name, tensor in model.state_dict().items()
            if tensor.is_floating_point()
        }
        verify_template(data, state)
    except (ModelError, OnnxTemplateError) as exc:
        raise _CliError(f"{args.precision} template: {exc}") from exc
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(data)
    except OSError as exc:
        raise _CliError(f"cannot write {args.out}: {exc}") from exc
    print(f"wrote {args.out} ({args.precision} template of {args.model}, {len(data)} bytes)")
    return EXIT_OK


def _run_bundle(args: argparse.Namespace) -> int:
    from edge_client.bundle.builder import BundleError, BundleOptions, DownloadError, build_bundle

    logging.getLogger().setLevel(logging.INFO)
    try:
        options = BundleOptions(
            out=args.out,
            profile=args.profile,
            platform=args.platform,
            python_version=args.python_version,
            torch_index=args.torch_index,
            torch_version=args.torch_version,
            config=args.config,
            onnx_template=args.onnx_template,
            coordinator_key=args.coordinator_key,
            memory_max=args.memory_max,
            cpu_quota=args.cpu_quota,
            extra_index_urls=tuple(args.extra_index_url),
        )
        report = build_bundle(options, progress=print)
    except DownloadError as exc:
        raise _RunError(str(exc)) from exc
    except BundleError as exc:
        raise _CliError(str(exc)) from exc
    print(report.summary())
    return EXIT_OK


def _run_infer(args: argparse.Namespace) -> int:
    # Lazy: onnxruntime is loaded only by this command, and torch never is.
    from edge_client.serve.infer import OnnxClassifier

    try:
        x = np.load(args.input, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise _CliError(f"cannot read input {args.input}: {exc}") from exc
    if not isinstance(x, np.ndarray):  # an .npz archive
        x.close()
        raise _CliError(f"input {args.input} is not a single .npy array")
    try:
        classifier = OnnxClassifier(args.model, threads=args.threads)
        _warn_if_never_trained(args.model)
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


NEVER_TRAINED = (
    "%s: this model was never trained: predictions are meaningless; run `edge_client "
    "follow` or fill it with trained weights first"
)


def _warn_if_never_trained(model: Path) -> None:
    """Warn, once, where ``model`` is a template still holding the untrained weights it
    was exported with (``python -m edge_client template`` writes one; ``follow`` fills
    it): its predictions are those of a random model, often one class for every input."""
    from edge_client.serve.template import MAX_TEMPLATE_BYTES, never_trained

    try:
        if model.stat().st_size > MAX_TEMPLATE_BYTES:
            return  # larger than any template
        data = model.read_bytes()
    except OSError:
        return  # onnxruntime has read it: a file removed since says nothing of it
    if never_trained(data):
        logging.getLogger("edge_client").warning(NEVER_TRAINED, model)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit code (see module docstring)."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments and arguments[0] not in (*COMMANDS, "-h", "--help"):
        arguments.insert(0, "run")  # the default command
    parser, _ = _build_parser()
    args = parser.parse_args(arguments)
    try:
        if args.command in CONFIGURABLE:
            device: _DeviceHandler = args.device_handler
            return device(_device_settings(args))
        handler: _Handler | None = getattr(args, "handler", None)
        if handler is None:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return handler(args)
    except (_CliError, ConfigError) as exc:
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
