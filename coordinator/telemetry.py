"""What an operator watches of a running fleet: :class:`FleetTelemetry`.

The coordinator keeps one (:attr:`~coordinator.runtime.Coordinator.telemetry`). The
engine thread feeds it every action the engine takes (rounds started and closed,
:class:`~coordinator.actions.UpdateOutcome`, published messages) and every device the
engine heard from; any thread, every refusal the engine or the runtime logged and the
evaluations an observer makes of the global models (the lab emulator's recorder, the
coordinator's ``--eval-data``). Its counters are kept as things happen (O(1) per event).

Readers on other threads (the Prometheus exporter, :mod:`coordinator.metrics`; the web
dashboard, :mod:`coordinator.dashboard`) never touch the engine: they read the
:class:`Snapshot` the engine thread publishes at most once per
:data:`SNAPSHOT_INTERVAL_S` while someone watches (:meth:`FleetTelemetry.watch`), an
immutable object swapped in whole. Building one costs O(devices) (the fleet table and
the transport's per-topic byte counters), once a second, never per event.

Everything here is bounded whatever devices or an attacker send: one row per
*registered* device (registration needs the device's key), refusals counted under a
fixed set of kinds (:data:`REFUSAL_KINDS`) with the last :data:`RECENT_REFUSALS` kept as
text cut to :data:`REFUSAL_TEXT_MAX` characters, the last :data:`ROUNDS_KEPT` rounds'
history. No key, token or payload byte is ever recorded.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from coordinator.actions import (
    Action,
    AggregateRequested,
    Finished,
    RoundClosed,
    RoundStarted,
    UpdateOutcome,
)
from protocol.errors import DecodeError
from protocol.messages import Hello, ReasonCode
from protocol.topics import parse_topic
from protocol.transport.stats import Counts, TrafficStats

__all__ = [
    "DURATION_BUCKETS_S",
    "RECENT_REFUSALS",
    "REFUSAL_KINDS",
    "REFUSAL_TEXT_MAX",
    "ROUNDS_KEPT",
    "SNAPSHOT_INTERVAL_S",
    "DeviceRow",
    "EngineView",
    "FleetTelemetry",
    "Histogram",
    "Refusal",
    "RoundPoint",
    "Snapshot",
    "TrafficKey",
]

SNAPSHOT_INTERVAL_S = 1.0
"""A new snapshot is built at most this often (while watched); less often where building
one takes over 1/20 of it (about 0.15 s at 10,000 devices on a 2-core CPU)."""

RECENT_REFUSALS = 100
"""Refusals kept as text for the dashboard."""

REFUSAL_TEXT_MAX = 200
"""Characters kept of a refusal's text (and of the device id it names: 64)."""

ROUNDS_KEPT = 1000
"""Rounds kept in the history the charts draw."""

DURATION_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Upper bounds (seconds) of the round and aggregation histograms (+Inf is implied)."""

REFUSAL_KINDS = (
    "auth",  # a frame whose tag or signature did not verify, or a revoked device's
    "foreign",  # a message naming another device or fleet than its topic's
    "replay",  # a replayed or stale frame (docs/protocol.md, section 7)
    "hello",  # a refused hello (model, precision, consent ...)
    "update",  # a rejected update (screening, shapes, round ...)
    "bad_input",  # undecodable input or over the device's quota
    "unexpected",  # a message of a kind the coordinator does not take, a stray topic
)
"""The kinds refusals are counted under; a refusal logged under another key counts as
``unexpected`` (the set must stay small: it is a metric label)."""

_KIND_OF_KEY = {
    "auth": "auth",
    "foreign": "foreign",
    "replay": "replay",
    "hello": "hello",
    "update": "update",
    "bad": "bad_input",
    "undecodable": "bad_input",
}

_NOTHING_MOVED = (0, 0)

Direction = Literal["up", "down"]
MessageKind = Literal["model", "update", "control"]


@dataclass(frozen=True)
class TrafficKey:
    """A label set of the byte counters: direction, what the message carries, and the
    precision of its weights (``none`` for control messages)."""

    direction: Direction
    kind: MessageKind
    precision: str


@dataclass(frozen=True)
class Histogram:
    """Observations in cumulative buckets (Prometheus's layout): ``counts[i]`` holds
    those <= ``DURATION_BUCKETS_S[i]``, the last entry all of them."""

    counts: tuple[int, ...]
    total: float
    """Sum of the observations."""

    @property
    def count(self) -> int:
        return self.counts[-1]


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(DURATION_BUCKETS_S) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        for i, bound in enumerate(DURATION_BUCKETS_S):
            if value <= bound:
                self.counts[i] += 1
        self.counts[-1] += 1

    def frozen(self) -> Histogram:
        return Histogram(tuple(self.counts), self.total)


@dataclass(frozen=True)
class Refusal:
    at: float
    """Unix time, seconds."""
    kind: str
    """One of :data:`REFUSAL_KINDS`."""
    text: str
    """The log line, cut to :data:`REFUSAL_TEXT_MAX` characters."""


@dataclass(frozen=True)
class DeviceRow:
    """One registered device as the fleet table shows it."""

    device_id: str
    group: str
    precisions: str
    """Down / up precisions, e.g. ``fp16/int8``."""
    weight_format: str
    online: bool
    last_seen: float | None
    """Unix time of the last authenticated frame from it (None: not since the start)."""
    rounds_answered: int
    """Rounds whose update of it was accepted on time (since this process started)."""
    last_outcome: str | None
    """The reason code of its last update's acknowledgement (``ok``, ``late``, ...)."""
    screening_ratio: float | None
    """Its last accepted update's distance from the model it was sent, over the round's
    reference (above ``max_update_norm_ratio`` is screened out)."""
    bytes_up: int
    bytes_down: int
    """Payload bytes from and to it so far."""


@dataclass(frozen=True)
class RoundPoint:
    """One closed round, for the charts."""

    round: int
    closed_at: float
    duration_s: float
    on_time: int
    selected: int
    late: int
    rejected: int
    aggregate_s: float
    bytes_up: int
    bytes_down: int
    """Payload bytes moved during the round (from the previous close to this one)."""
    models: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """Model name -> metric (``amp``, ``wlp`` ...) -> percent; filled in when the round's
    evaluation arrives (it may come a round later, or never without one)."""


@dataclass(frozen=True)
class Snapshot:
    """Everything the exporter and the dashboard show, as of ``at``."""

    at: float
    fleet: str
    strategy: str
    rounds_planned: int
    round: int
    phase: str
    deadline: float | None
    registered: int
    online: int
    selected: int
    answered: int
    rounds_completed: int
    updates: Mapping[str, int]
    """Reason code (``ok``, ``late``, ``duplicate``, a rejection's) -> updates answered
    so."""
    refusals: Mapping[str, int]
    """Kind (:data:`REFUSAL_KINDS`) -> refusals."""
    enrolments: int
    traffic: Mapping[TrafficKey, Counts]
    round_seconds: Histogram
    aggregate_seconds: Histogram
    server_step_s: float
    """The last round's server step, seconds."""
    models: Mapping[str, Mapping[str, float]]
    """Model name -> metric -> percent, of the latest evaluated round."""
    history: Sequence[RoundPoint]
    recent_refusals: Sequence[Refusal]
    devices: Sequence[DeviceRow]
    """Sorted by device id."""


@dataclass
class _Activity:
    answered: int = 0
    last_outcome: str | None = None
    ratio: float | None = None
    last_seen: float | None = None


class EngineView(Protocol):
    """What the telemetry reads of the engine on the engine thread (implemented by
    :class:`~coordinator.engine.RoundEngine`)."""

    def progress(self) -> tuple[int, str, float | None, int, int]:
        """Round, phase, deadline (Unix s; None outside training), selected, answered."""

    def devices(self) -> tuple[Mapping[str, Hello], frozenset[str]]:
        """The registry's entries and its online set (read on the engine thread)."""

    def link_of(self, device_id: str) -> tuple[str, str]:
        """The precisions ``device_id`` transfers in: down, up."""


class FleetTelemetry:
    """See the module docstring.

    Args:
        fleet, strategy, rounds: the run's names and length (shown as they are).
        engine: read when a snapshot is built.
        traffic: the coordinator's transport counters (bytes per topic).
        enrolments: how many devices enrolled with the fleet token so far (None: no
            enrolment).
        clock: Unix time, seconds.
    """

    def __init__(
        self,
        *,
        fleet: str,
        strategy: str,
        rounds: int,
        engine: EngineView,
        traffic: TrafficStats,
        enrolments: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._fleet, self._strategy, self._rounds = fleet, strategy, rounds
        self._engine = engine
        self._traffic = traffic
        self._enrolments = enrolments
        self._clock = clock
        self._activity: dict[str, _Activity] = {}
        self._updates: dict[str, int] = {}
        self._refusals = dict.fromkeys(REFUSAL_KINDS, 0)
        self._recent: deque[Refusal] = deque(maxlen=RECENT_REFUSALS)
        self._refusal_lock = threading.Lock()
        self._rounds_completed = 0
        self._round_hist = _Histogram()
        self._aggregate_hist = _Histogram()
        self._server_step_s = 0.0
        self._history: deque[RoundPoint] = deque(maxlen=ROUNDS_KEPT)
        self._models: dict[str, dict[str, float]] = {}
        self._evaluated: dict[int, dict[str, dict[str, float]]] = {}
        self._topics: dict[str, tuple[str, MessageKind] | None] = {}
        """Topic -> (device id or "", kind): topics parsed once."""
        self._closed_traffic = (0, 0)
        self._watchers = 0
        self._built_at = -math.inf
        self._interval = SNAPSHOT_INTERVAL_S
        self._snapshot: Snapshot | None = None
        self._changed = threading.Condition()
        self._version = 0

    # -- fed on the engine thread -----------------------------------------------------

    def __call__(self, action: Action) -> None:
        """An observer of the coordinator's actions."""
        if isinstance(action, UpdateOutcome):
            self._updates[action.reason.value] = self._updates.get(action.reason.value, 0) + 1
            activity = self._activity.setdefault(action.device_id, _Activity())
            activity.last_outcome = action.reason.value
            if action.reason is ReasonCode.OK:
                activity.answered += 1
            if action.screening_ratio is not None:
                activity.ratio = action.screening_ratio
        elif isinstance(action, RoundClosed):
            self._closed(action)
            self.refresh(force=True)
        elif isinstance(action, (RoundStarted, AggregateRequested, Finished)):
            self.refresh(force=True)

    def heard(self, device_id: str, now: float) -> None:
        """The engine took an authenticated, fresh frame of the registered device
        ``device_id`` (so rows stay bounded by the registry)."""
        self._activity.setdefault(device_id, _Activity()).last_seen = now

    def refused(self, key: str, text: str) -> None:
        """A refusal logged under ``key`` (:class:`~coordinator.auth.RateLimitedLog`).
        Thread-safe: the runtime refuses unauthenticated input on the transport's
        thread, before it reaches the engine."""
        kind = _KIND_OF_KEY.get(key.partition(":")[0], "unexpected")
        refusal = Refusal(self._clock(), kind, text[:REFUSAL_TEXT_MAX])
        with self._refusal_lock:
            self._refusals[kind] += 1
            self._recent.append(refusal)

    def evaluated(self, round_number: int, models: Mapping[str, Mapping[str, float]]) -> None:
        """The global models after ``round_number`` were evaluated: model name -> metric
        (``amp``, ``wlp``, ...) -> percent. Thread-safe (the evaluation may run on a
        thread of its own); the latest snapshot gets it at once (an evaluation may come
        after the run's last event: the last round's, in the sim)."""
        with self._changed:
            self._evaluated[round_number] = {k: dict(v) for k, v in models.items()}
            while len(self._evaluated) > ROUNDS_KEPT:
                del self._evaluated[min(self._evaluated)]
            if self._snapshot is not None:
                history, latest = self._with_evaluations(self._snapshot.history)
                self._snapshot = replace(self._snapshot, history=history, models=latest)
                self._version += 1
                self._changed.notify_all()

    def _with_evaluations(
        self, history: Sequence[RoundPoint]
    ) -> tuple[list[RoundPoint], dict[str, dict[str, float]]]:
        """``history`` with each round's evaluation, and the latest evaluation (the
        caller holds ``_changed``)."""
        evaluated = self._evaluated
        points = [
            replace(p, models=evaluated[p.round]) if p.round in evaluated else p for p in history
        ]
        return points, evaluated[max(evaluated)] if evaluated else {}

    def _closed(self, closed: RoundClosed) -> None:
        self._rounds_completed += 1
        self._round_hist.observe(closed.duration_s)
        self._aggregate_hist.observe(closed.aggregate_s)
        self._server_step_s = closed.aggregate_s
        up = self._traffic.totals("in").payload_bytes
        down = self._traffic.totals("out").payload_bytes
        last_up, last_down = self._closed_traffic
        self._closed_traffic = (up, down)
        self._history.append(
            RoundPoint(
                round=closed.round,
                closed_at=self._clock(),
                duration_s=closed.duration_s,
                on_time=closed.on_time,
                selected=closed.selected,
                late=closed.late,
                rejected=closed.rejected,
                aggregate_s=closed.aggregate_s,
                bytes_up=up - last_up,
                bytes_down=down - last_down,
            )
        )

    # -- snapshots --------------------------------------------------------------------

    def watch(self) -> None:
        """Someone reads snapshots from now on (an exporter, a dashboard): the engine
        thread builds them. Thread-safe."""
        with self._changed:
            self._watchers += 1
            self._built_at = -math.inf

    def refresh(self, *, force: bool = False) -> None:
        """Build a new snapshot if someone watches and the last one is older than
        :data:`SNAPSHOT_INTERVAL_S` (or ``force``). Engine thread only."""
        now = self._clock()
        if self._watchers == 0 or (not force and now - self._built_at < self._interval):
            return
        started = time.perf_counter()
        snapshot = self._build(now)
        # a big fleet's snapshot takes a while: never more than 1/20 of the engine thread
        self._interval = max(SNAPSHOT_INTERVAL_S, 20 * (time.perf_counter() - started))
        with self._changed:
            self._snapshot = snapshot
            self._built_at = now
            self._version += 1
            self._changed.notify_all()

    def snapshot(self) -> Snapshot | None:
        """The latest snapshot (None before the first). Thread-safe."""
        return self._snapshot

    def wait_changed(self, version: int, timeout: float) -> tuple[int, Snapshot | None]:
        """Block until a snapshot newer than ``version`` is published or ``timeout``
        passes; returns the current version and snapshot. Thread-safe."""
        with self._changed:
            if self._version <= version:
                self._changed.wait(timeout)
            return self._version, self._snapshot

    def _build(self, now: float) -> Snapshot:
        round_number, phase, deadline, selected, answered = self._engine.progress()
        entries, online = self._engine.devices()
        links = {device_id: self._engine.link_of(device_id) for device_id in entries}
        traffic, per_device = self._traffic_by_label(links)
        with self._changed:
            history, latest = self._with_evaluations(self._history)
        with self._refusal_lock:
            refusals, recent = dict(self._refusals), list(self._recent)
        rows = []
        for device_id in sorted(entries):
            hello = entries[device_id]
            activity = self._activity.get(device_id) or _Activity()
            down, up = links[device_id]
            moved = per_device.get(device_id, _NOTHING_MOVED)
            rows.append(
                DeviceRow(
                    device_id=device_id,
                    group=hello.architecture,
                    precisions=f"{down}/{up}",
                    weight_format=hello.weight_format,
                    online=device_id in online,
                    last_seen=activity.last_seen,
                    rounds_answered=activity.answered,
                    last_outcome=activity.last_outcome,
                    screening_ratio=activity.ratio,
                    bytes_up=moved[0],
                    bytes_down=moved[1],
                )
            )
        return Snapshot(
            at=now,
            fleet=self._fleet,
            strategy=self._strategy,
            rounds_planned=self._rounds,
            round=min(round_number, self._rounds),
            phase=phase,
            deadline=deadline,
            registered=len(entries),
            online=len(online),
            selected=selected,
            answered=answered,
            rounds_completed=self._rounds_completed,
            updates=dict(self._updates),
            refusals=refusals,
            enrolments=0 if self._enrolments is None else self._enrolments(),
            traffic=traffic,
            round_seconds=self._round_hist.frozen(),
            aggregate_seconds=self._aggregate_hist.frozen(),
            server_step_s=self._server_step_s,
            models=latest,
            history=history,
            recent_refusals=recent,
            devices=rows,
        )

    def _traffic_by_label(
        self, links: Mapping[str, tuple[str, str]]
    ) -> tuple[dict[TrafficKey, Counts], dict[str, list[int]]]:
        """The transport's per-topic counters summed per label set, and each device's
        payload bytes ``[up, down]`` (plain ints and tuples in the loop: it runs over
        every topic of the fleet, six per device)."""
        sums: dict[tuple[Direction, MessageKind, str], list[int]] = {}
        per_device: dict[str, list[int]] = {}
        for stats_direction, by_topic in self._traffic.snapshot().items():
            direction: Direction = "up" if stats_direction == "in" else "down"
            side = 0 if direction == "up" else 1
            for topic, counts in by_topic.items():
                parsed = self._topics[topic] if topic in self._topics else self._parse(topic)
                if parsed is None:
                    continue
                device_id, kind = parsed
                precision = "none"
                if kind != "control":
                    if device_id:
                        link = links.get(device_id)
                        precision = "unknown" if link is None else link[side]
                    else:
                        precision = "broadcast"
                total = sums.get((direction, kind, precision))
                if total is None:
                    total = sums[direction, kind, precision] = [0, 0, 0]
                total[0] += counts.messages
                total[1] += counts.payload_bytes
                total[2] += counts.wire_bytes
                if device_id:
                    moved = per_device.get(device_id)
                    if moved is None:
                        moved = per_device[device_id] = [0, 0]
                    moved[side] += counts.payload_bytes
        traffic = {TrafficKey(*key): Counts(*total) for key, total in sums.items()}
        return traffic, per_device

    def _parse(self, topic: str) -> tuple[str, MessageKind] | None:
        """(device id or "", what the topic carries) of a topic of the layout; None
        outside it. Parsed once per topic."""
        try:
            info = parse_topic(topic)
        except DecodeError:
            parsed = None  # counted nowhere: the topic is outside the layout
        else:
            leaf = info.leaf
            kind: MessageKind = (
                "model" if leaf == "model" else "update" if leaf == "update" else "control"
            )
            parsed = (info.device_id or "", kind)
        if len(self._topics) < 1_000_000:  # stray topics cannot grow it without bound
            self._topics[topic] = parsed
        return parsed
