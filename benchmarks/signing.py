"""The price of the coordinator's signature on fleet-wide frames (docs/protocol.md, 2.5).

A device verifies every coordinator status and every broadcast model it reads; the
coordinator signs each once. Measured per frame, with the reference implementation
(``protocol.signing``, Ed25519 from ``cryptography``): signing and verifying a status
frame and a broadcast model (LeNet-5 and ResNet-8 weights at fp32 and int8; a model of
more than one MQTT payload is signed as a whole and chunk by chunk, and a receiver
verifies each chunk), beside what a device spends decoding the same model anyway
(decompress, unpack, dequantize). The budget: verifying a broadcast must not cost more
than decoding it.

Run::

    python -m benchmarks.signing            # median of 20 repeats per figure
    python -m benchmarks.signing --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from protocol.chunking import DEFAULT_MAX_PAYLOAD, split_frame
from protocol.codec import Codec, signed_twin
from protocol.messages import CoordinatorStatus, Message, ModelPayload
from protocol.samples import sample_weights
from protocol.signing import SigningKey
from protocol.tensorset import encode_tensors

FLEET = "lab"
STATUS = f"fl/{FLEET}/coordinator/status"
BROADCAST = f"fl/{FLEET}/broadcast/model"


def median_s(action: Callable[[], object], repeat: int) -> float:
    """The median wall time of ``action`` over ``repeat`` runs (after one warm-up)."""
    action()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def signed_parts(key: SigningKey, topic: str, frame: bytes) -> tuple[bytes, list[bytes]]:
    """The signed message frame and what goes on the wire: itself, or its signed chunks."""
    signed = key.sign(topic, signed_twin(frame))
    parts = split_frame(signed, DEFAULT_MAX_PAYLOAD)
    return signed, parts if len(parts) == 1 else [key.sign(topic, p) for p in parts]


def measure(repeat: int) -> list[dict[str, Any]]:
    codec, key = Codec(), SigningKey.generate()
    verify = key.verify_key
    rows = []
    status = Message(fleet=FLEET, sender="coordinator", body=CoordinatorStatus(state="running"))
    cases: list[tuple[str, str, Message]] = [("status", STATUS, status)]
    for model in ("lenet5", "resnet8"):
        for precision in ("fp32", "int8"):
            sets = {"global": encode_tensors(sample_weights(model), precision)}
            message = Message(fleet=FLEET, sender="coordinator", body=ModelPayload(sets=sets))
            cases.append((f"{model} {precision}", BROADCAST, message))
    for name, topic, message in cases:
        frame = codec.encode(message)
        signed, parts = signed_parts(key, topic, frame)

        def sign_all(frame: bytes = frame, topic: str = topic) -> None:
            signed_parts(key, topic, frame)

        def verify_all(parts: list[bytes] = parts, topic: str = topic) -> None:
            # what a receiver checks: every payload (chunks bind the whole frame's
            # SHA-256, which reassembly checks: the whole is not verified again)
            for part in parts:
                verify.verify(topic, part)

        def decode(signed: bytes = signed, message: Message = message) -> None:
            decoded = codec.decode(signed)
            if isinstance(decoded.body, ModelPayload):
                for tensor_set in decoded.body.sets.values():
                    tensor_set.to_arrays()

        sign_s, verify_s, decode_s = (median_s(f, repeat) for f in (sign_all, verify_all, decode))
        rows.append(
            {
                "frame": name,
                "bytes": len(signed),
                "payloads": len(parts),
                "sign_us": sign_s * 1e6,
                "verify_us": verify_s * 1e6,
                "decode_us": decode_s * 1e6,
                "verify_over_decode": verify_s / decode_s,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| frame | bytes | MQTT payloads | sign (us) | verify (us) | decode (us) | verify / decode |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['frame']} | {r['bytes']:,} | {r['payloads']} | {r['sign_us']:.0f} | "
            f"{r['verify_us']:.0f} | {r['decode_us']:.0f} | {r['verify_over_decode']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--repeat", type=int, default=20, help="repeats per figure (default 20)")
    p.add_argument("--json", action="store_true", help="print one JSON array")
    args = p.parse_args(argv)
    rows = measure(args.repeat)
    print(json.dumps(rows, indent=2) if args.json else markdown(rows))
    models = [r for r in rows if r["frame"] != "status"]
    return 0 if all(r["verify_over_decode"] <= 1.0 for r in models) else 1


if __name__ == "__main__":
    sys.exit(main())
