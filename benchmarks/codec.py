"""Codec benchmark: compression ratio and single-thread speed of every tensor encoding.

For two tensor sets with trained-looking weights (``protocol.samples``): LeNet-5 (61,706
parameters) and ResNet-8 with FedKF widths (1,227,594). For each encoding it reports:

- ``ratio``: fp32 bytes (4 per parameter) / bytes of the whole encoded message frame
  (envelope, metadata, quantization parameters and zstd included);
- ``encode_MBps`` / ``decode_MBps``: fp32-equivalent MB/s (10**6 bytes) through the full
  path: arrays -> tensor set -> message -> msgpack -> zstd frame, and back to arrays;
- ``overhead_pct``: envelope and metadata bytes (names, shapes, keys) over tensor bytes,
  in percent, measured on the uncompressed envelope.

Run: ``python benchmarks/codec.py [--json] [--repeats N] [--level L]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from protocol.codec import Codec
from protocol.messages import Message, ModelPayload
from protocol.samples import sample_weights
from protocol.tensors import Encoding, encode_tensors

SETS = {"lenet5": "lenet5", "resnet8": "resnet8"}
ENCODINGS: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "fp32"},
    "fp32_shuffle": {"precision": "fp32", "shuffle": True},
    "fp16": {"precision": "fp16"},
    "bf16": {"precision": "bf16"},
    "int8": {"precision": "int8", "per_tensor": True},
    "int8_ch": {"precision": "int8"},
    "int4_ch": {"precision": "int4"},
}
TARGETS = {
    "int8_ch encode_MBps (resnet8)": (">=", 1000),
    "int8_ch decode_MBps (resnet8)": (">=", 3000),
    "fp32 encode_MBps (resnet8)": (">=", 400),
    "int8_ch ratio": (">=", 3.9),
    "int4_ch ratio": (">=", 7.5),
    "fp16 ratio": (">=", 2.0),
    "overhead_pct": ("<=", 0.5),
}


def timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    weights: dict[str, np.ndarray], spec: dict[str, Any], codec: Codec, repeats: int
) -> dict[str, float]:
    fp32_bytes = 4 * sum(v.size for v in weights.values())
    encodings = (
        {k: Encoding.INT8 for k, v in weights.items() if v.ndim >= 2}
        if spec.get("per_tensor")
        else None
    )

    def encode() -> bytes:
        sets = {
            "model": encode_tensors(
                weights, spec["precision"], shuffle=spec.get("shuffle", False), encodings=encodings
            )
        }
        return codec.encode(
            Message(fleet="bench", sender="coordinator", body=ModelPayload(sets=sets))
        )

    frame = encode()

    def decode() -> dict[str, np.ndarray]:
        return codec.decode(frame).tensor_sets()["model"].to_arrays()

    message = codec.decode(frame)
    tensor_bytes = message.tensor_sets()["model"].nbytes
    envelope_bytes = len(codec.pack(message))
    return {
        "ratio": fp32_bytes / len(frame),
        "encode_MBps": fp32_bytes / timed(encode, repeats) / 1e6,
        "decode_MBps": fp32_bytes / timed(decode, repeats) / 1e6,
        "frame_bytes": len(frame),
        "overhead_pct": 100 * (envelope_bytes - tensor_bytes) / tensor_bytes,
    }


def run(repeats: int, level: int) -> dict[str, Any]:
    codec = Codec(level=level)
    results: dict[str, Any] = {"zstd_level": level, "sets": {}}
    for set_name, model in SETS.items():
        weights = sample_weights(model)
        params = sum(v.size for v in weights.values())
        rows = {name: measure(weights, spec, codec, repeats) for name, spec in ENCODINGS.items()}
        results["sets"][set_name] = {"parameters": params, "encodings": rows}
    return results


def print_table(results: dict[str, Any]) -> None:
    print(f"zstd level {results['zstd_level']}, one thread; MB/s are fp32-equivalent (10^6 B/s)")
    for set_name, data in results["sets"].items():
        print(f"\n{set_name} ({data['parameters']:,} parameters)")
        print(
            f"{'encoding':<14}{'ratio':>7}{'encode MB/s':>13}{'decode MB/s':>13}{'frame B':>11}{'overhead %':>12}"
        )
        for name, r in data["encodings"].items():
            print(
                f"{name:<14}{r['ratio']:>7.2f}{r['encode_MBps']:>13.0f}{r['decode_MBps']:>13.0f}"
                f"{r['frame_bytes']:>11}{r['overhead_pct']:>12.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats (median)")
    parser.add_argument("--level", type=int, default=3, choices=[1, 2, 3], help="zstd level")
    args = parser.parse_args()
    results = run(args.repeats, args.level)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)


if __name__ == "__main__":
    main()
