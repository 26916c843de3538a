"""What a round's server step costs the coordinator: seconds and peak memory.

FedAvg's server step is a weighted sum; FedDF distils every architecture group's model
from the ensemble of the round's updates on proxy images (``feddf``) or on the samples
of a generator it trains against the ensemble first (``feddf-gen``,
``--distill-data generator``); DENSE trains an image
generator against the ensemble and distils a fresh model per group on its samples. This
benchmark runs one strategy's ``aggregate`` exactly as the coordinator's aggregation
phase does (same strategy objects, same :class:`~coordinator.context.ServerContext`),
each configuration in a fresh interpreter so that its peak RSS is its own:

- ``setup_rss``: the process once torch, the models, the updates and the proxy images
  are loaded;
- ``peak_rss``: the peak of the whole process, the aggregation included;
- ``aggregate_s``: the server step alone;
- ``peak_gpu``: the most CUDA memory allocated (``--server-device cuda``).

The updates are ``--teachers`` models per configuration, seeded random initialisations
of the fleet's architectures in turn: the cost of a server step depends on the models'
sizes, not on what they learned. FedDF's early stopping is switched off (patience =
steps), so each group takes its full ``--distill-steps``; a real run stops earlier when
the held-out KL stops improving (its log says after how many steps).

    python -m benchmarks.server_cost [--data-dir ../shared/data] [--server-device cpu]
        [--only feddf-gen ...] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

CONFIGS: list[dict[str, Any]] = [
    {"strategy": "fedavg", "model": "lenet5", "teachers": 5},
    {"strategy": "feddf", "model": "lenet5", "teachers": 5},
    {"strategy": "feddf-gen", "model": "lenet5", "teachers": 5},
    {"strategy": "dense", "model": "lenet5", "teachers": 5},
    {"strategy": "fedavg", "model": "resnet8,lenet5,fedgen_cnn", "teachers": 6},
    {"strategy": "feddf", "model": "resnet8,lenet5,fedgen_cnn", "teachers": 6},
    {"strategy": "feddf-gen", "model": "resnet8,lenet5,fedgen_cnn", "teachers": 6},
    {"strategy": "dense", "model": "resnet8,lenet5,fedgen_cnn", "teachers": 6},
]


def _measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration's server step in this process (the child's side)."""
    import torch

    from coordinator.config import CoordinatorConfig
    from coordinator.context import ServerContext, resolve_server_device
    from coordinator.proxy import proxy_tensor, read_proxy_data
    from coordinator.runtime import build_models
    from coordinator.strategies.base import Contribution
    from coordinator.strategies.registry import build_strategy
    from models import build_classifier, seeded, state_arrays

    steps = int(spec["distill_steps"])
    generated = spec["strategy"] == "feddf-gen"
    config = CoordinatorConfig(
        strategy="feddf" if generated else spec["strategy"],
        distill_data="generator" if generated else "proxy",
        model=spec["model"],
        rounds=1,
        seed=0,
        server_device=spec["server_device"],
        distill_steps=steps,
        distill_patience=steps,
    )
    device = resolve_server_device(config.server_device)
    templates = build_models(config)
    strategy = build_strategy(config, templates)
    groups = list(templates)
    updates = []
    for index in range(int(spec["teachers"])):
        group = groups[index % len(groups)]
        with seeded(index + 1):
            model = build_classifier(group, num_classes=config.num_classes)
        updates.append(Contribution(f"dev-{index}", group, state_arrays(model), 100))
    proxy = None
    if strategy.needs_proxy_data:
        images = read_proxy_data(Path(spec["proxy_file"]))  # as python -m coordinator does
        proxy = proxy_tensor(images, config.sample_shape)
    current = {name: {"aca": state_arrays(t)} for name, t in templates.items()}
    context = ServerContext.for_round(device, config.seed, 1, proxy_data=proxy)
    setup_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    strategy.aggregate(current, iter(updates), 1, context)
    seconds = time.perf_counter() - start
    return {
        **{k: spec[k] for k in ("strategy", "model", "teachers")},
        "device": str(device),
        "aggregate_s": round(seconds, 2),
        "setup_rss_bytes": setup_rss,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
    }


def _proxy_images(data_dir: Path | None, size: int) -> np.ndarray:
    """``size`` EMNIST-letters train images from ``data_dir``, or uniform noise images
    without one (the cost does not depend on what the images show)."""
    if data_dir is None:
        return np.random.default_rng(0).random((size, 1, 28, 28), dtype=np.float32)
    from sim.datasets import load_proxy_images

    return load_proxy_images(data_dir / "emnist-letters", size=size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, help="folder with emnist-letters/ (proxy)")
    parser.add_argument("--proxy-size", type=int, default=20000, help="proxy images")
    parser.add_argument("--distill-steps", type=int, default=500)
    parser.add_argument("--server-device", choices=("auto", "cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=sorted({c["strategy"] for c in CONFIGS}),
        help="measure only these strategies' rows",
    )
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: one JSON spec
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(_measure(json.loads(args.one))))
        return
    with tempfile.TemporaryDirectory() as scratch:
        proxy_file = Path(scratch) / "proxy.npy"
        np.save(proxy_file, _proxy_images(args.data_dir, args.proxy_size))
        rows = []
        for config in CONFIGS:
            if args.only and config["strategy"] not in args.only:
                continue
            spec = {
                **config,
                "proxy_file": str(proxy_file),
                "distill_steps": args.distill_steps,
                "server_device": args.server_device,
            }
            print(f"# {config['strategy']} on {config['model']} ...", file=sys.stderr, flush=True)
            child = [sys.executable, "-m", "benchmarks.server_cost", "--one", json.dumps(spec)]
            out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"\nserver step, one round ({rows[0]['device']}; FedDF {args.distill_steps} steps)\n")
    print("| strategy | models | updates | seconds | setup RSS | peak RSS | peak GPU |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['strategy']} | {r['model']} | {r['teachers']} | {r['aggregate_s']:.1f} | "
            f"{r['setup_rss_bytes'] / 1e6:.0f} MB | {r['peak_rss_bytes'] / 1e6:.0f} MB | "
            f"{r['peak_gpu_bytes'] / 1e6:.0f} MB |"
        )


if __name__ == "__main__":
    main()
