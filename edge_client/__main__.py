"""Command line of the edge client: ``python -m edge_client <command> ...``.

Commands:
    infer   classify images from a ``.npy`` file with an ONNX model; prints one JSON
            object ``{"predictions": [...], "batch": N, "latency_ms": ...}`` to stdout
            and optionally saves the predictions (or logits) as ``.npy``.

Each command imports what it needs when it runs, so ``infer`` never imports torch.

Exit codes:
    0   success
    2   usage error, or the model / input could not be read or did not match; one line
        on stderr, no traceback
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from edge_client.errors import EdgeClientError

EXIT_OK = 0
EXIT_USAGE = 2

_Handler = Callable[[argparse.Namespace], int]


class _CliError(Exception):
    """A user-facing failure: printed as one line on stderr, exit code 2."""


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m edge_client", description="Edge federated-learning client."
    )
    commands = parser.add_subparsers(dest="command", metavar="<command>")

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
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = _build_parser()
    args = parser.parse_args(argv)
    handler: _Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return handler(args)
    except _CliError as exc:
        message = " ".join(str(exc).splitlines())
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
