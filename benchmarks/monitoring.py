"""What watching a fleet costs at 1,000 and 10,000 devices (issue "See a live fleet").

A real :class:`~coordinator.engine.RoundEngine` (in memory, no authentication) registers
N devices by their hellos; the transport's byte counters hold six topics per device, as a
round leaves them. Its :class:`~coordinator.telemetry.FleetTelemetry` is watched by the
Prometheus exporter and the web dashboard, both served on loopback. Reported per fleet
size:

* ``snapshot_s``: the median time the engine thread spends building one snapshot (the
  fleet table and the byte counters, O(devices)), and ``interval_s``, how often it then
  builds one (at most 1/20 of the engine thread goes to it);
* ``hello_us``: the engine's time per hello, with the telemetry fed as the runtime feeds
  it (what the fleet's growth costs the engine);
* ``scrape_s`` / ``scrape_bytes`` / ``series``: one GET of ``/metrics`` and what it
  returns (the series count must not grow with the fleet);
* ``page_s``: one page of 200 rows of the dashboard's fleet table sorted by bytes up,
  the first request after a new snapshot (it sorts) and ``page_cached_s`` the next;
* ``event_bytes``: the summary each server-sent event carries (it must not grow with the
  fleet).

Run from the repository root::

    python -m benchmarks.monitoring                  # 1,000 and 10,000 devices
    python -m benchmarks.monitoring --devices 1000 --json rows.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from coordinator.config import CoordinatorConfig
from coordinator.engine import RoundEngine
from coordinator.events import Received
from coordinator.groups import ArchitectureGroup
from coordinator.monitor import monitoring
from coordinator.runtime import build_models
from coordinator.store import MemoryStore
from coordinator.strategies.registry import build_strategy
from coordinator.telemetry import FleetTelemetry
from protocol.messages import Hello, Message
from protocol.tensors import Precision
from protocol.topics import DeviceLeaf, DownLeaf, Topics
from protocol.transport.stats import TrafficStats

FLEET = "bench"


def _engine(devices: int) -> tuple[RoundEngine, FleetTelemetry, TrafficStats, float]:
    config = CoordinatorConfig(
        fleet=FLEET, model="lenet5", min_devices=devices + 1, insecure_no_auth=True
    )
    templates = build_models(config)
    engine = RoundEngine(
        config,
        build_strategy(config, templates),
        MemoryStore(),
        {name: ArchitectureGroup.of(t) for name, t in templates.items()},
    )
    traffic = TrafficStats()
    telemetry = FleetTelemetry(
        fleet=FLEET, strategy=config.strategy, rounds=config.rounds, engine=engine, traffic=traffic
    )
    engine.watch(telemetry.heard, telemetry.refused)
    for action in engine.start(time.time()):
        telemetry(action)
    (template,) = templates.values()
    topics = Topics(FLEET)
    started = time.perf_counter()
    for i in range(devices):
        device_id = f"dev-{i:05d}"
        hello = Hello(
            device_id=device_id,
            architecture=template.architecture,
            fingerprint=template.fingerprint(),
            precisions=(Precision.FP32, Precision.INT8),
            uplink_precision=Precision.INT8 if i % 2 else None,
            memory_bytes=0,
            threads=1,
            software_version="bench",
            num_samples=100,
        )
        message = Message(fleet=FLEET, sender=device_id, body=hello)
        for action in engine.handle(Received(device_id, message, time.time())):
            telemetry(action)
    hello_us = 1e6 * (time.perf_counter() - started) / devices
    for i in range(devices):
        device_id = f"dev-{i:05d}"
        up: tuple[DeviceLeaf, ...] = ("hello", "update", "status")
        down: tuple[DownLeaf, ...] = ("task", "model", "ack")
        for leaf in up:
            traffic.record("in", topics.device(device_id, leaf), 1000 + i, 1100 + i)
        for back in down:
            traffic.record("out", topics.to_device(device_id, back), 2000 + i, 2100 + i)
    return engine, telemetry, traffic, hello_us


def _get(url: str) -> tuple[float, bytes]:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as response:  # loopback only
        body: bytes = response.read()
    return time.perf_counter() - started, body


def measure(devices: int, repeat: int) -> dict[str, Any]:
    """One row of the table at ``devices`` registered devices."""
    gc.collect()  # the previous size's garbage is not this one's cost
    _, telemetry, _, hello_us = _engine(devices)
    gc.collect()
    settings = CoordinatorConfig(
        fleet=FLEET, insecure_no_auth=True, metrics_port="127.0.0.1:0", dashboard="127.0.0.1:0"
    )
    with monitoring(telemetry, settings) as served:
        metrics_url, dashboard_url = (s.url.rstrip("/") for s in served)
        builds = []
        for _ in range(repeat):
            started = time.perf_counter()
            telemetry.refresh(force=True)
            builds.append(time.perf_counter() - started)
        scrape_s, exposition = _get(metrics_url)
        series = sum(
            1 for line in exposition.decode().splitlines() if line and not line.startswith("#")
        )
        query = "/api/devices?sort=bytes_up&order=desc&limit=200"
        page_s, page = _get(dashboard_url + query)
        page_cached_s, _ = _get(dashboard_url + query)
        assert len(json.loads(page)["rows"]) == min(200, devices)
        _, event = _get(dashboard_url + "/api/summary")
    return {
        "devices": devices,
        "hello_us": round(hello_us, 1),
        "snapshot_s": round(statistics.median(builds), 4),
        "interval_s": round(max(1.0, 20 * statistics.median(builds)), 2),
        "scrape_s": round(scrape_s, 4),
        "scrape_bytes": len(exposition),
        "series": series,
        "page_s": round(page_s, 4),
        "page_cached_s": round(page_cached_s, 4),
        "event_bytes": len(event),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--devices", default="1000,10000", help="comma-separated fleet sizes")
    p.add_argument("--repeat", type=int, default=5, help="snapshots timed per size")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    rows = [measure(int(n), args.repeat) for n in args.devices.split(",")]
    keys = list(rows[0])
    print(" ".join(f"{k:>14}" for k in keys))
    for row in rows:
        print(" ".join(f"{row[k]:>14}" for k in keys))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
