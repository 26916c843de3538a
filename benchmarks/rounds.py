"""Per-round device compute time and bytes of every federated mode, side by side.

For each mode (FedAvg, FedKF dual, FedKF single, FedGen full, FedGen head) and each
model (LeNet-5 and FedGen's CNN) it runs the real emulation (``sim.run_simulation``:
coordinator + emulated devices through the in-memory broker twin, which counts the same
bytes as MQTT) on the synthetic dataset and reports, averaged over the rounds after the second (FedGen
sends no generator in round 1, and in round 2 FedKF's OCA model still equals the ACA
model, a repeat zstd compresses away within the message; from round 3 on they differ):

- ``train_s``: local training time per selected device per round (what the devices
  report in their updates: the strategy's whole local step, generators included);
- ``up`` / ``down``: encoded payload bytes per selected device per round, and
  ``wire_up`` / ``wire_down`` the same as MQTT packets;
- ``down_vs_fedavg``: the downlink against FedAvg's with the same model.

Every mode trains the same number of local mini-batches (``--local-steps``, default 20,
batch ``--batch-size``, default 32), so the compute times compare the work per batch.
One training runs at a time (the fleet's loop trainer, one torch thread), as on one device.

Run from the repository root: ``python -m benchmarks.rounds [--rounds 4] [--devices 10]
[--models lenet5 fedgen_cnn] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import torch

from coordinator.config import TrainingSettings
from sim.run import SimConfig, run_simulation

MODES: dict[str, dict[str, str]] = {
    "fedavg": {"strategy": "fedavg"},
    "fedkf-dual": {"strategy": "fedkf", "downlink": "dual"},
    "fedkf-single": {"strategy": "fedkf", "downlink": "single"},
    "fedgen-full": {"strategy": "fedgen", "sharing": "full"},
    "fedgen-head": {"strategy": "fedgen", "sharing": "head"},
}


def measure(model: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One emulated run of ``mode`` on ``model``; per-device per-round figures."""
    config = SimConfig(
        devices=args.devices,
        rounds=args.rounds,
        participation=args.participation,
        model=model,
        transport="inproc",
        training=TrainingSettings(local_steps=args.local_steps, batch_size=args.batch_size),
        seed=args.seed,
        **MODES[mode],
    )
    report = run_simulation(config)
    rounds = report.rounds[2:] or report.rounds
    per_device = {
        key: statistics.fmean(getattr(r, key) / max(1, r.active_devices) for r in rounds)
        for key in ("bytes_up", "bytes_down", "wire_bytes_up", "wire_bytes_down")
    }
    train = [r.device_train_s for r in rounds if r.device_train_s is not None]
    return {
        "model": model,
        "mode": mode,
        "train_s": statistics.fmean(train) if train else None,
        "up": round(per_device["bytes_up"]),
        "down": round(per_device["bytes_down"]),
        "wire_up": round(per_device["wire_bytes_up"]),
        "wire_down": round(per_device["wire_bytes_down"]),
        "rounds_measured": len(rounds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["lenet5", "fedgen_cnn"])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--participation", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per run (>= 3)")
    parser.add_argument("--local-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.rounds < 3:
        parser.error("--rounds must be at least 3 (rounds 1 and 2 are not measured)")
    torch.set_num_threads(1)
    results = []
    for model in args.models:
        fedavg_down = None
        for mode in args.modes:
            print(f"measuring {model} {mode} ...", file=sys.stderr)
            row = measure(model, mode, args)
            if mode == "fedavg":
                fedavg_down = row["down"]
            row["down_vs_fedavg"] = round(row["down"] / fedavg_down, 3) if fedavg_down else None
            results.append(row)
    settings = {k: getattr(args, k) for k in ("devices", "participation", "rounds")}
    settings |= {"local_steps": args.local_steps, "batch_size": args.batch_size}
    if args.json:
        print(json.dumps({"settings": settings, "results": results}, indent=2))
        return
    print(
        f"per selected device per round ({args.local_steps} local steps of batch "
        f"{args.batch_size}; mean of rounds 3..{args.rounds}; bytes are payload, wire in "
        "brackets)"
    )
    print(f"{'model':<11} {'mode':<13} {'train s':>8} {'up':>20} {'down':>20} {'down/FedAvg':>11}")
    for r in results:
        train = "-" if r["train_s"] is None else f"{r['train_s']:.3f}"
        up = f"{r['up']:,} ({r['wire_up']:,})"
        down = f"{r['down']:,} ({r['wire_down']:,})"
        ratio = "-" if r["down_vs_fedavg"] is None else f"{r['down_vs_fedavg']:.2f}x"
        print(f"{r['model']:<11} {r['mode']:<13} {train:>8} {up:>20} {down:>20} {ratio:>11}")


if __name__ == "__main__":
    main()
