"""Emulated fleets: many devices in one process, each running its own device session.

The sim's cohort driver. A :class:`Fleet` runs one
:class:`~edge_client.train.session.DeviceSession` per emulated device — the session a
real device's shell runs, so there is one device — over a bounded pool of broker
connections (each device keeps its id and its topics), with a few threads whatever the
fleet's size. Training goes through a :class:`FleetTrainer`: the jobs of many devices in,
their results out; :class:`LoopTrainer` is the per-device reference, a batched engine
implements the same protocol.

Modules: ``driver`` (:class:`Fleet`, :class:`FleetOptions`), ``pool`` (the connections
and their publishers), ``batching`` (which jobs go to the trainer together),
``trainer`` (the seam and the loop trainer), ``devices`` (a device's session and
state folder), ``window`` (how many hellos and updates may wait for the coordinator's
answer), ``pacing`` (how fast the devices publish). See docs/fleet.md.
"""

from __future__ import annotations

from sim.fleet.batching import DEFAULT_LINGER_S, DEFAULT_MAX_COHORT, CohortQueue
from sim.fleet.driver import DEFAULT_CONNECTIONS, Fleet, FleetOptions
from sim.fleet.trainer import (
    FleetDevice,
    FleetTrainer,
    LoopTrainer,
    TrainerFactory,
    WrappedTrainer,
)

__all__ = [
    "DEFAULT_CONNECTIONS",
    "DEFAULT_LINGER_S",
    "DEFAULT_MAX_COHORT",
    "CohortQueue",
    "Fleet",
    "FleetDevice",
    "FleetOptions",
    "FleetTrainer",
    "LoopTrainer",
    "TrainerFactory",
    "WrappedTrainer",
]
