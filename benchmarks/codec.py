"""Codec benchmark: compression ratio and single-thread speed of every tensor encoding.

For two tensor sets with trained-looking weights (``protocol.samples``): LeNet-5 (61,706
parameters) and ResNet-8 with FedKF widths (1,227,594). For each encoding it reports:

- ``ratio``: fp32 bytes (4 per parameter) / bytes of the whole encoded message frame
  (envelope, metadata, quantization parameters and zstd included);
- ``encode_MBps`` / ``decode_MBps``: fp32-equivalent MB/s (10**6 bytes) through the full
  path: arrays -> tensor set -> message -> msgpack -> zstd frame, and back to arrays;
- ``overhead_pct``: envelope and metadata bytes (names, shapes, keys) over tensor bytes,
  in percent, measured on the uncompressed envelope;
- ``tensor_encode_MBps`` / ``tensor_decode_MBps``: the tensor encodings alone (arrays <->
  encoded tensors: quantize, pack, dequantize), without envelope and zstd, to show where
  the full path spends its time.

Run: ``python -m benchmarks.codec [--json] [--repeats N] [--level L]``.
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
from protocol.tensors import Encoding
from protocol.tensorset import TensorSet, encode_tensors

SETS = ("lenet5", "resnet8")  # names in protocol.samples.MODEL_SHAPES
ENCODINGS: dict[str, dict[str, Any]] = {
    "fp32": {"precision": "fp32"},
    "fp32_shuffle": {"precision": "fp32", "shuffle": True},
    "fp16": {"precision": "fp16"},
    "bf16": {"precision": "bf16"},
    "int8": {"precision": "int8", "per_tensor": True},
    "int8_ch": {"precision": "int8"},
    "int4_ch": {"precision": "int4"},
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

    def encode_set() -> TensorSet:
        return encode_tensors(
            weights, spec["precision"], shuffle=spec.get("shuffle", False), encodings=encodings
        )

    def encode() -> bytes:
        sets = {"model": encode_set()}
        return codec.encode(
            Message(fleet="bench", sender="coordinator", body=ModelPayload(sets=sets))
        )

    frame = encode()

    def decode() -> dict[str, np.ndarray]:
        return codec.decode(frame).tensor_sets()["model"].to_arrays()

    message = codec.decode(frame)
    tensor_set = message.tensor_sets()["model"]
    tensor_bytes = tensor_set.nbytes
    envelope_bytes = len(codec.pack(message))
    return {
        "ratio": fp32_bytes / len(frame),
        "encode_MBps": fp32_bytes / timed(encode, repeats) / 1e6,
        "decode_MBps": fp32_bytes / timed(decode, repeats) / 1e6,
        "frame_bytes": len(frame),
        "overhead_pct": 100 * (envelope_bytes - tensor_bytes) / tensor_bytes,
        "tensor_encode_MBps": fp32_bytes / timed(encode_set, repeats) / 1e6,
        "tensor_decode_MBps": fp32_bytes / timed(tensor_set.to_arrays, repeats) / 1e6,
    }


def run(repeats: int, level: int) -> dict[str, Any]:
    codec = Codec(level=level)
    results: dict[str, Any] = {"zstd_level": level, "sets": {}}
    for set_name in SETS:
        weights = sample_weights(set_name)
        params = sum(v.size for v in weights.values())
        rows = {name: measure(weights, spec, codec, repeats) for name, spec in ENCODINGS.items()}
        results["sets"][set_name] = {"parameters": params, "encodings": rows}
    return results


def print_table(results: dict[str, Any]) -> None:
    print(f"zstd level {results['zstd_level']}, one thread; MB/s are fp32-equivalent (10^6 B/s)")
    for set_name, data in results["sets"].items():
        print(f"\n{set_name} ({data['parameters']:,} parameters)")
        print(
            f"{'encoding':<14}{'ratio':>7}{'encode MB/s':>13}{'decode MB/s':>13}{'frame B':>11}"
            f"{'overhead %':>12}{'tensor enc':>12}{'tensor dec':>12}"
        )
        for name, r in data["encodings"].items():
            print(
                f"{name:<14}{r['ratio']:>7.2f}{r['encode_MBps']:>13.0f}{r['decode_MBps']:>13.0f}"
                f"{r['frame_bytes']:>11}{r['overhead_pct']:>12.3f}"
                f"{r['tensor_encode_MBps']:>12.0f}{r['tensor_decode_MBps']:>12.0f}"
            )


def check_targets(results: dict[str, Any]) -> dict[str, bool]:
    """Which of the issue's targets the measured figures meet."""
    big = results["sets"]["resnet8"]["encodings"]
    ratios = {s: d["encodings"] for s, d in results["sets"].items()}
    return {
        "int8_ch encode_MBps >= 1000 (resnet8)": big["int8_ch"]["encode_MBps"] >= 1000,
        "int8_ch decode_MBps >= 3000 (resnet8)": big["int8_ch"]["decode_MBps"] >= 3000,
        "fp32 encode_MBps >= 400 (resnet8)": big["fp32"]["encode_MBps"] >= 400,
        "int8_ch ratio >= 3.9 (both sets)": all(
            r["int8_ch"]["ratio"] >= 3.9 for r in ratios.values()
        ),
        "int4_ch ratio >= 7.5 (both sets)": all(
            r["int4_ch"]["ratio"] >= 7.5 for r in ratios.values()
        ),
        "fp16 ratio >= 2.0 (both sets)": all(r["fp16"]["ratio"] >= 2.0 for r in ratios.values()),
        "overhead <= 0.5 % (resnet8, every encoding)": all(
            r["overhead_pct"] <= 0.5 for r in big.values()
        ),
        "overhead <= 0.5 % (lenet5, float encodings)": all(
            results["sets"]["lenet5"]["encodings"][e]["overhead_pct"] <= 0.5
            for e in ("fp32", "fp16", "bf16")
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats (median)")
    parser.add_argument("--level", type=int, default=3, choices=[1, 2, 3], help="zstd level")
    args = parser.parse_args()
    results = run(args.repeats, args.level)
    results["targets"] = check_targets(results)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print_table(results)
        print("\ntargets:")
        for name, met in results["targets"].items():
            print(f"  {'met ' if met else 'MISS'}  {name}")


if __name__ == "__main__":
    main()
