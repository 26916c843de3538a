"""The ``budget`` command of ``python -m sim``: bytes per device and round, no fleet run."""

from __future__ import annotations

import argparse
import json
from typing import Any

from coordinator.cli_flags import add_fleet_flags, add_training_flags
from coordinator.report import human_bytes
from protocol.flags import ModelFlags
from sim.allocator import keep_freed_memory
from sim.budget import (
    LINK_PROFILES,
    RATE_SYNTAX,
    Budget,
    LinkProfile,
    estimate_with_reference,
    link_profile,
    transfer_time,
)
from sim.progress import TerminalProgress
from sim.run import SimConfig
from sim.run_cli import DATA_CHOICES, add_engine_flags, describe, sim_config

__all__ = ["add_budget_parser", "budget_from_args", "budget_json", "format_budget"]

EXIT_OK = 0

_FLEET = (
    "devices",
    "strategy",
    "downlink",
    "sharing",
    "downlink_precision",
    "uplink_precision",
    "downlink_deltas",
    "teacher_budget",
    "model",
    "rounds",
    "participation",
    "seed",
)
_TRAINING = ("local_epochs", "local_steps", "batch_size", "generator_noise_dim", "generator_hidden")
"""The training settings that change what travels (FedGen's generator shape)."""


def add_budget_parser(sub: Any) -> None:
    """Add the ``budget`` command to the subparsers ``sub``."""
    parser = sub.add_parser(
        "budget",
        help="bytes per device and round of a configuration, next to fp32 FedAvg",
        description="Measure the bytes a configuration moves, up and down, per device and "
        "round, per round and for the whole run, MQTT payload and wire, next to the fp32 "
        "FedAvg reference, without running the fleet: the real coordinator engine and "
        "encoders, emulated devices training as the fleet would (docs/budget.md).",
    )
    flags = ModelFlags()
    parser.set_defaults(handler=budget_from_args, settings_flags=flags)
    fleet = parser.add_argument_group("fleet")
    add_fleet_flags(fleet, flags, SimConfig, include=_FLEET)
    flags.add(
        fleet, SimConfig, include=("device_precisions",), metavars={"device_precisions": "LIST"}
    )
    add_training_flags(parser.add_argument_group("training (the tasks)"), flags, _TRAINING)
    flags.add(
        parser.add_argument_group("data"),
        SimConfig,
        include=("dataset", "data_dir", "alpha", "proxy_data", "proxy_size"),
        choices=DATA_CHOICES,
        metavars={"proxy_data": "PATH", "proxy_size": "N"},
    )
    add_engine_flags(
        parser,
        flags,
        engine_help="how the devices of a round train: batched (all at once, sim.cohort) or "
        "loop (one after the other, the per-device reference); auto is batched on any "
        "device (a run's auto is the loop on a CPU, where its wire needs the cores)",
    )
    budget = parser.add_argument_group("budget")
    budget.add_argument(
        "--link",
        metavar="NAME|BITS_PER_S",
        help=f"add transfer times over a link: {', '.join(LINK_PROFILES)}, or {RATE_SYNTAX}",
    )
    budget.add_argument("--json", action="store_true", help="print one JSON object")
    budget.add_argument(
        "--progress-every",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="off a terminal (a pipe, a log), seconds between two progress lines on stderr "
        "(default 10); on a terminal a live bar",
    )


def budget_from_args(args: argparse.Namespace) -> int:
    """Handler of ``python -m sim budget``."""
    link = None if args.link is None else link_profile(args.link)  # bad links fail first
    config = sim_config(args)
    keep_freed_memory()  # this process trains on the CPU: no page faults every step
    with TerminalProgress(config.rounds, every_s=args.progress_every) as progress:
        budget, reference = estimate_with_reference(config, progress=progress)
    if args.json:
        print(json.dumps(budget_json(budget, reference, link), indent=1))
    else:
        print(format_budget(budget, reference, link))
    return EXIT_OK


_SIM_ONLY = {
    "transport",
    "broker_url",
    "connections",
    "state_dir",
    "round_timeout_s",
    "engine",
    "device",
    "max_cohort",
}


def budget_json(
    budget: Budget, reference: Budget, link: LinkProfile | None = None
) -> dict[str, Any]:
    """The JSON object of ``python -m sim budget --json`` (see docs/budget.md)."""

    def part(b: Budget) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device_rounds": b.device_rounds,
            "per_device_round": b.per_device_round.to_dict(),
            "per_round": b.per_round.to_dict(),
            "total": b.total.to_dict(),
            "by_kind": {k: v.to_dict() for k, v in sorted(b.by_kind.items())},
        }
        if link is not None:
            out["seconds_per_device_round"] = transfer_time(b.per_device_round, link).to_dict()
        return out

    config = budget.config.model_dump(mode="json", exclude=_SIM_ONLY)  # alpha inf: "inf"
    result: dict[str, Any] = {"config": config}
    result.update(part(budget))
    result["reference"] = {
        "config": reference.config.model_dump(
            mode="json", include={"strategy", "sharing", "downlink_precision", "uplink_precision"}
        ),
        **part(reference),
    }
    result["ratio"] = {
        key: round(value / ref, 4) if ref else None
        for (key, value), ref in zip(
            budget.total.to_dict().items(), reference.total.to_dict().values(), strict=True
        )
    }
    if link is not None:
        result["link"] = {
            "name": link.name,
            "up_bps": link.up_bps,
            "down_bps": link.down_bps,
            "latency_s": link.latency_s,
        }
    return result


_FIELDS = (("up", "up"), ("down", "down"), ("wire_up", "wire up"), ("wire_down", "wire down"))


def format_budget(budget: Budget, reference: Budget, link: LinkProfile | None = None) -> str:
    """The human-readable table: the configuration, the reference and their ratio."""
    config = budget.config
    out = [
        f"{config.model} on {config.dataset}: {config.devices} devices, C={config.participation}, "
        f"{config.rounds} rounds, seed {config.seed}: {budget.device_rounds} device-rounds "
        f"(reference {reference.device_rounds})",
        "weights trained as the fleet would; MQTT payload and wire bytes",
    ]
    rows = [("", describe(config, compact=True), describe(reference.config, compact=True), "ratio")]
    scopes = (
        ("per device-round", budget.per_device_round, reference.per_device_round),
        ("per round", budget.per_round, reference.per_round),
        ("whole run", budget.total, reference.total),
    )
    for scope, mine, theirs in scopes:
        for index, (key, label) in enumerate(_FIELDS):
            a, b = getattr(mine, key), getattr(theirs, key)
            rows.append((_label(scope, index, label), human_bytes(a), human_bytes(b), _ratio(a, b)))
    if link is not None:
        mine_t = transfer_time(budget.per_device_round, link)
        theirs_t = transfer_time(reference.per_device_round, link)
        for index, key in enumerate(("up", "down", "total")):
            a, b = getattr(mine_t, key), getattr(theirs_t, key)
            name = _label("s/device-round", index, key)
            rows.append((name, _seconds(a), _seconds(b), _ratio(a, b)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    table = [
        f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}"
        for r in rows
    ]
    out += table[: 1 + len(scopes) * len(_FIELDS)]
    if link is not None:
        out.append(
            f"link {link.name}: {_rate(link.up_bps)} up, {_rate(link.down_bps)} down, "
            f"{link.latency_s:g} s latency (once each way per device-round)"
        )
        out += table[1 + len(scopes) * len(_FIELDS) :]
    return "\n".join(out)


def _label(scope: str, index: int, what: str) -> str:
    return f"{scope if index == 0 else '':<17}{what}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def _rate(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"


def _seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    return f"{s:.3g} s"
