"""Classifier benchmark: training speed, ONNX fp32 vs int8 size and latency, inference memory.

Per classifier (lenet5, resnet8 at FedDF widths 16/32/64 and FedKF widths 64/128/256,
fedgen_cnn, mlp; all on 1x28x28 inputs, 10 classes) it reports:

- ``train_img_s``: SGD training throughput, images/s (batch 64, 2 torch threads, after
  warm-up steps);
- ``fp32_kB`` / ``int8_kB`` / ``size_ratio``: ONNX file sizes (kB = 1000 bytes) and
  int8 / fp32 (static QDQ quantization, per-channel, calibrated on 256 train images);
- ``fp32_b1_ms`` ... ``int8_b64_ms``: median latency of one call, ms, batch 1 and 64,
  onnxruntime on 1 thread through :class:`edge_client.serve.infer.OnnxClassifier`;
- ``rss_b1_MB`` / ``rss_b64_MB``: peak RSS (VmHWM; MB = 2**20 bytes) of a fresh process
  running ``python -m edge_client infer`` with the int8 model on 1 / 64 images (the
  inference-only deployment).

Then a lenet5 is trained for one epoch (Adam, batch 64) on the train split and the int8
model's top-1 agreement with the fp32 model is measured on the whole test split (MNIST:
10,000 images).

Data: MNIST from ``--data-dir`` (the folder with the IDX files or its parent); the
synthetic dataset when no folder is given. Run from the repository root:
``python -m benchmarks.classifiers [--data-dir DIR] [--quick] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.harness import child_env
from edge_client.serve.infer import OnnxClassifier
from models import Classifier, build_classifier
from models.onnx_export import export_onnx, quantize_onnx_int8, top1_agreement
from sim.datasets import ArrayDataset, load_dataset

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "lenet5": ("lenet5", {}),
    "resnet8-16/32/64": ("resnet8", {"widths": (16, 32, 64)}),
    "resnet8-64/128/256": ("resnet8", {"widths": (64, 128, 256)}),
    "fedgen_cnn": ("fedgen_cnn", {}),
    "mlp": ("mlp", {}),
}
TARGETS = {
    "size_ratio": ("<=", 0.3),
    "agreement_pct": (">=", 99.0),
    "rss_b1_MB": ("<=", 80.0),
    "rss_b64_MB": ("<=", 80.0),
}
BATCH = 64
CALIBRATION_IMAGES = 256


def train_throughput(model: nn.Module, data: ArrayDataset, steps: int, warmup: int) -> float:
    """Images per second of plain SGD steps (batch 64) on real data."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, len(data), BATCH) for _ in range(warmup + steps)]
    model.train()
    start = 0.0
    for i, idx in enumerate(batches):
        if i == warmup:
            start = time.perf_counter()
        optimizer.zero_grad()
        x, y = torch.from_numpy(data.x[idx]), torch.from_numpy(data.y[idx])
        torch.autograd.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
    return steps * BATCH / (time.perf_counter() - start)


def median_latency_ms(classifier: OnnxClassifier, x: np.ndarray, repeats: int) -> float:
    """Median wall time of one ``predict_logits`` call, ms, after 3 warm-up calls."""
    for _ in range(3):
        classifier.predict_logits(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        classifier.predict_logits(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000.0


# Appended to the code a child runs: prints its peak RSS (kB). VmHWM belongs to the
# process image since exec; getrusage's ru_maxrss would carry over the parent's peak.
_RSS_PROBE = """
import sys
with open("/proc/self/status") as status:
    print("peak-rss-kB", next(l for l in status if l.startswith("VmHWM")).split()[1],
          file=sys.stderr)
"""
_RUN_EDGE_CLIENT = """
import runpy
try:
    runpy.run_module("edge_client", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    assert not exc.code, exc.code
"""


def peak_rss_mb(code: str, *argv: str) -> float:
    """Peak RSS of a fresh ``python -c code argv...`` process, MB (2**20 bytes); Linux."""
    env = child_env()
    done = subprocess.run(
        [sys.executable, "-c", code + _RSS_PROBE, *argv],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("peak-rss-kB")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"child failed ({done.returncode}): {done.stderr.strip()}")
    return int(lines[-1].split()[1]) / 1024.0


def bench_model(
    label: str, model: Classifier, data: ArrayDataset, quick: bool, workdir: Path
) -> dict[str, Any]:
    """One table row; see the module docstring for the columns."""
    train_img_s = train_throughput(model, data, steps=5 if quick else 40, warmup=3 if quick else 10)
    model.eval()
    fp32 = export_onnx(model, model.input_shape)
    int8 = quantize_onnx_int8(fp32, data.x[:CALIBRATION_IMAGES])
    row: dict[str, Any] = {
        "model": label,
        "params": sum(p.numel() for p in model.parameters()),
        "train_img_s": round(train_img_s, 1),
        "fp32_kB": round(len(fp32) / 1000, 1),
        "int8_kB": round(len(int8) / 1000, 1),
        "size_ratio": round(len(int8) / len(fp32), 3),
    }
    repeats = {1: 20 if quick else 200, BATCH: 5 if quick else 30}
    for name, blob in (("fp32", fp32), ("int8", int8)):
        classifier = OnnxClassifier(blob, threads=1)
        for batch, n in repeats.items():
            row[f"{name}_b{batch}_ms"] = round(median_latency_ms(classifier, data.x[:batch], n), 3)
    model_path = workdir / f"{label.replace('/', '-')}.int8.onnx"
    model_path.write_bytes(int8)
    for batch in (1, BATCH):
        input_path = workdir / f"x{batch}.npy"
        np.save(input_path, data.x[:batch])
        cli = ["infer", "--model", str(model_path), "--input", str(input_path)]
        row[f"rss_b{batch}_MB"] = round(peak_rss_mb(_RUN_EDGE_CLIENT, *cli), 1)
    return row


def agreement(train: ArrayDataset, test: ArrayDataset, quick: bool) -> dict[str, Any]:
    """Train lenet5 for one epoch, quantize it, compare int8 with fp32 on ``test``."""
    torch.manual_seed(0)
    model = build_classifier("lenet5", num_classes=train.num_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    order = np.random.default_rng(0).permutation(len(train))[: 2048 if quick else None]
    start = time.perf_counter()
    model.train()
    for i in range(0, len(order), BATCH):
        idx = order[i : i + BATCH]
        optimizer.zero_grad()
        x, y = torch.from_numpy(train.x[idx]), torch.from_numpy(train.y[idx])
        torch.autograd.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
    train_s = time.perf_counter() - start
    fp32 = export_onnx(model, model.input_shape)
    int8 = quantize_onnx_int8(fp32, train.x[order[:CALIBRATION_IMAGES]])
    accuracy = {}
    for name, blob in (("fp32", fp32), ("int8", int8)):
        classifier = OnnxClassifier(blob, threads=2)
        predictions = np.concatenate(
            [classifier.predict(test.x[i : i + 1000]) for i in range(0, len(test), 1000)]
        )
        accuracy[name] = round(100 * float(np.mean(predictions == test.y)), 2)
    return {
        "train_images": len(order),
        "train_s": round(train_s, 1),
        "test_images": len(test),
        "fp32_acc_pct": accuracy["fp32"],
        "int8_acc_pct": accuracy["int8"],
        "agreement_pct": round(100 * top1_agreement(fp32, int8, test.x), 2),
    }


def check(value: float, target: tuple[str, float]) -> bool:
    op, bound = target
    return value <= bound if op == "<=" else value >= bound


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--data-dir", type=Path, help="MNIST folder (default: synthetic data)")
    parser.add_argument("--quick", action="store_true", help="few steps and repeats: smoke run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    torch.set_num_threads(2)
    dataset = "mnist" if args.data_dir is not None else "synthetic"
    splits = load_dataset(dataset, args.data_dir)
    assert splits.test is not None
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgefl-bench-") as tmp:
        for label, (name, options) in MODELS.items():
            torch.manual_seed(0)
            model = build_classifier(name, num_classes=splits.train.num_classes, **options)
            rows.append(bench_model(label, model, splits.train, args.quick, Path(tmp)))
    python_rss = peak_rss_mb("pass")
    torch_rss = peak_rss_mb("import torch")
    agree = agreement(splits.train, splits.test, args.quick)
    verdicts = {
        "size_ratio": {r["model"]: check(r["size_ratio"], TARGETS["size_ratio"]) for r in rows},
        "rss_b1_MB": {r["model"]: check(r["rss_b1_MB"], TARGETS["rss_b1_MB"]) for r in rows},
        "rss_b64_MB": {r["model"]: check(r["rss_b64_MB"], TARGETS["rss_b64_MB"]) for r in rows},
        "agreement_pct": check(agree["agreement_pct"], TARGETS["agreement_pct"]),
    }
    result = {
        "dataset": dataset,
        "quick": args.quick,
        "torch_threads": 2,
        "onnxruntime_threads": 1,
        "models": rows,
        "reference_rss_MB": {"python": round(python_rss, 1), "import torch": round(torch_rss, 1)},
        "lenet5_int8_agreement": agree,
        "targets": {k: f"{op} {bound}" for k, (op, bound) in TARGETS.items()},
        "meets_targets": verdicts,
    }
    if args.json:
        print(json.dumps(result))
        return
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print(f"dataset: {dataset}{' (quick)' if args.quick else ''}; torch 2 threads, ORT 1 thread")
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(columns, widths, strict=True)))
    print(f"reference peak RSS: bare python {python_rss:.1f} MB, import torch {torch_rss:.1f} MB")
    print("lenet5 int8 vs fp32: " + ", ".join(f"{k}={v}" for k, v in agree.items()))
    for key, (op, bound) in TARGETS.items():
        print(f"target {key} {op} {bound}: {verdicts[key]}")


if __name__ == "__main__":
    main()
