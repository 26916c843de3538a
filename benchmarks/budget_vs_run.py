"""How close ``python -m sim budget`` comes to the bytes a real emulated run moves.

For each configuration (precision x strategy, same seed and settings) it runs the budget
(:func:`sim.budget.estimate`) and the emulation (:func:`sim.run.run_simulation`) and
prints both totals, up and down (MQTT payload bytes), and the budget's deviation in
percent. The target is every deviation within 2 %.

Default: 20 devices, C = 0.2, 5 rounds, LeNet-5, the synthetic dataset; fp32, int8 and
int4 FedAvg and FedKF (dual downlink), FedProx and FedGen at int8.

Run: ``python -m benchmarks.budget_vs_run [--devices 20] [--rounds 5]
[--participation 0.2] [--transport inproc|mqtt] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from sim.budget import estimate
from sim.run import SimConfig, run_simulation

TARGET_PCT = 2.0
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("fedavg fp32", {"strategy": "fedavg"}),
    ("fedavg int8", {"strategy": "fedavg", "downlink_precision": "int8", "uplink_precision": "int8"}),
    ("fedavg int4", {"strategy": "fedavg", "downlink_precision": "int4", "uplink_precision": "int4"}),
    ("fedprox int8", {"strategy": "fedprox", "downlink_precision": "int8", "uplink_precision": "int8"}),
    ("fedkf fp32", {"strategy": "fedkf"}),
    ("fedkf int8", {"strategy": "fedkf", "downlink_precision": "int8", "uplink_precision": "int8"}),
    ("fedgen int8", {"strategy": "fedgen", "downlink_precision": "int8", "uplink_precision": "int8"}),
]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--participation", type=float, default=0.2)
    parser.add_argument("--model", default="lenet5")
    parser.add_argument("--transport", default="inproc", choices=("inproc", "mqtt"))
    parser.add_argument("--only", help="comma-separated names of the configurations to run")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    wanted = None if args.only is None else set(args.only.split(","))
    rows = []
    print(f"{'configuration':14} {'budget up':>11} {'run up':>11} {'dev up':>7} "
          f"{'budget down':>12} {'run down':>11} {'dev down':>8} {'budget s':>9} {'run s':>7}",
          flush=True)  # fmt: skip
    worst = 0.0
    for name, settings in CONFIGS:
        if wanted is not None and name not in wanted:
            continue
        config = SimConfig(
            devices=args.devices,
            rounds=args.rounds,
            participation=args.participation,
            model=args.model,
            transport=args.transport,
            **settings,
        )
        start = time.perf_counter()
        budget = estimate(config)
        budget_s = time.perf_counter() - start
        start = time.perf_counter()
        final = run_simulation(config).final
        run_s = time.perf_counter() - start
        up, down = final["bytes_up"], final["bytes_down"]
        dev_up = 100 * (budget.total.up - up) / up
        dev_down = 100 * (budget.total.down - down) / down
        worst = max(worst, abs(dev_up), abs(dev_down))
        rows.append(
            {
                "configuration": name,
                "budget_up": budget.total.up,
                "run_up": up,
                "deviation_up_pct": round(dev_up, 3),
                "budget_down": budget.total.down,
                "run_down": down,
                "deviation_down_pct": round(dev_down, 3),
                "budget_s": round(budget_s, 2),
                "run_s": round(run_s, 2),
            }
        )
        print(f"{name:14} {budget.total.up:11d} {up:11d} {dev_up:+6.2f}% "
              f"{budget.total.down:12d} {down:11d} {dev_down:+7.2f}% {budget_s:9.1f} {run_s:7.1f}",
              flush=True)  # fmt: skip
    verdict = "within" if worst <= TARGET_PCT else "OUTSIDE"
    print(f"largest deviation {worst:.2f} %: {verdict} the {TARGET_PCT:.0f} % target")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
