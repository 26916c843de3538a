"""What the coordinator persists, and how it stays consistent across crashes.

Layout of the :class:`~coordinator.store.Store` (one atomic record per key):

=========================  =================================================================
key                        record
=========================  =================================================================
``run``                    state format, config fingerprint, current round, phase, selected
                           devices, task ids, deadline, the updates a closing round
                           aggregates (metadata only)
``screened/rNNNNNN/DEVICE`` a selected device whose on-time update of round ``N`` was
                           rejected for its values (empty; one record each, so screening
                           one out writes O(1) whatever the fleet's size, where rewriting
                           ``run`` is O(devices)): the round does not wait for it
``registry/DEVICE``        the registry's entry of ``DEVICE``, what its hello announced
                           (metadata only; one record per device, so registering one
                           writes O(1) whatever the fleet's size)
``models/rNNNNNN/G/ROLE``  global model ``ROLE`` (``aca``, ...) of architecture group ``G``
                           that round ``N`` starts from
``updates/DEVICE/rNNNNNN`` an accepted update of ``DEVICE`` for round ``N``: its metadata (the
                           device's group among it) and weights. Writing it is the commit
                           point of acceptance.
``bases/DEVICE/sent``       the model (as decoded) the device's current task gives it: round,
                           content fingerprint, arrays; quantized transfers only
``bases/DEVICE/held``       the same for the model the device is known to hold (it
                           uploaded a delta against it or announced it): downlink deltas
                           are taken against it
``oca/G``                  group ``G``'s OCA running sum ``S = sum_k n_k w_k`` (float64), total
                           weight and which update of each of its devices is inside the sum
=========================  =================================================================

Write order makes every crash recoverable (:meth:`RunState.recover`):

* accept an update: write ``updates/D/rN`` (now it is accepted and never lost), then, for
  strategies with an OCA cache, write ``oca/G`` (``G`` the device's group) with the
  device's new slot folded in, then delete the device's previous update record (its old
  slot).
* close round ``N``: write ``run`` in phase ``aggregating`` with the devices whose on-time
  updates the round aggregates; aggregate (off the engine thread; nothing is written);
  write ``models/r(N+1)/*/*``, then ``run`` with round ``N+1`` (the commit point), then
  delete ``models/rN/*`` and round ``N``'s update records no slot refers to. A crash
  before the commit point leaves round ``N``'s models and updates in place: the resumed
  coordinator aggregates the same updates again, so none is lost or counted twice.

Recovery redoes what a crash interrupted: it folds into its group's ``oca/G`` any newest
update record the sum does not hold yet (each device's slot is its newest record, and the
sum records which round it holds, so nothing is counted twice), and deletes records, model
versions and screened-out marks the committed ``run`` no longer needs. The cache slots
live only in the store; RAM holds the running sum, O(model) whatever the number of
devices.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, cast, get_args

import numpy as np
import numpy.typing as npt
from pydantic import ValidationError

from coordinator.averaging import WeightedSum
from coordinator.errors import StateMismatchError, StoreError
from coordinator.groups import GroupModels
from coordinator.store import Store
from protocol.messages import Hello, WeightFormat

__all__ = ["STATE_FORMAT", "Base", "OcaCache", "RunMeta", "RunState", "StoredUpdate"]

log = logging.getLogger(__name__)

Array = npt.NDArray[Any]
Phase = Literal["waiting", "training", "aggregating", "finished"]
_ROUND_KEY = re.compile(r"^r(\d{6,})$")

STATE_FORMAT = 1
"""The layout of the records above. A state directory written with another format (or
by a version from before formats were numbered) is refused on ``--resume`` with a
message saying so, never read as if it were this one."""


def _weight_format(value: object) -> WeightFormat:
    """``value`` of a stored record as a weight format (records before the field:
    ``float``).

    Raises:
        ValueError: not a weight format (the caller reports a corrupt record).
    """
    if value not in get_args(WeightFormat):
        raise ValueError(f"unknown weight format {value!r}")
    return cast(WeightFormat, value)


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


def _round_key(number: int) -> str:
    return f"r{number:06d}"


@dataclass
class RunMeta:
    """The ``run`` record: where the run stands."""

    fingerprint: dict[str, Any]
    """Settings that must match on ``--resume``."""
    round: int = 1
    """The current round (1-based); after the last round, ``rounds + 1``."""
    phase: Phase = "waiting"
    """``waiting``: no round in progress; ``training``: tasks are out; ``aggregating``:
    the round's updates are being aggregated; ``finished``."""
    selected: list[str] = field(default_factory=list)
    task_ids: dict[str, str] = field(default_factory=dict)
    """Device -> message id of its task this round."""
    deadline: float = 0.0
    """Unix time (s) after which updates of this round are late."""
    started_at: float = 0.0
    aggregating: list[str] = field(default_factory=list)
    """Phase ``aggregating``: the devices whose on-time update the round aggregates."""
    counted: list[str] = field(default_factory=list)
    """The devices whose update of round ``round - 1`` the current model holds (so that a
    resend of one, whose ack a crash lost, is answered ``duplicate``, not ``late``)."""
    counted_ids: dict[str, str] = field(default_factory=dict)
    """Device -> message id of its update in ``counted``: only that very message is
    answered ``duplicate`` (a store written before this field has none: any update of a
    counted device is)."""
    norm_floor: float | None = None
    """Norm screening's reference from the rounds before (:mod:`coordinator.screening`)."""
    screened_out: list[str] = field(default_factory=list)
    """Selected devices whose on-time update of this round was rejected for its values,
    as versions before the ``screened/rNNNNNN/DEVICE`` records kept them (written empty
    now, still honoured on resume): the round does not wait for them."""
    state_format: int = STATE_FORMAT
    """The :data:`STATE_FORMAT` the store was written with."""

    def counted_updates(self) -> dict[str, str | None]:
        """Device -> id of its update the previous round counted (None: not recorded)."""
        return {d: self.counted_ids.get(d) for d in self.counted}

    def to_meta(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> RunMeta:
        try:
            return cls(
                fingerprint=dict(meta["fingerprint"]),
                round=int(meta["round"]),
                phase=meta["phase"],
                selected=[str(d) for d in meta["selected"]],
                task_ids={str(k): str(v) for k, v in meta["task_ids"].items()},
                deadline=float(meta["deadline"]),
                started_at=float(meta["started_at"]),
                aggregating=[str(d) for d in meta["aggregating"]],
                counted=[str(d) for d in meta["counted"]],
                counted_ids={str(k): str(v) for k, v in meta.get("counted_ids", {}).items()},
                norm_floor=_optional_float(meta.get("norm_floor")),
                screened_out=[str(d) for d in meta["screened_out"]],
                state_format=int(meta["state_format"]),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StoreError(f"corrupt run record: {exc}") from exc


@dataclass(frozen=True)
class StoredUpdate:
    """Metadata of an accepted update record."""

    device_id: str
    group: str
    """The device's architecture group."""
    round: int
    num_samples: int
    message_id: str
    on_time: bool
    received_at: float
    metrics: dict[str, float] = field(default_factory=dict)
    label_counts: list[int] | None = None
    """Per-class training samples, where the strategy asked for them (FedGen)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase, as the device reported them (``train_s``, ...)."""
    weight_format: WeightFormat = "float"
    """The format the device ran the model at when it trained it (kept with the update:
    FedDF takes its teacher at it, and a resumed aggregation must see what the first
    one saw, whatever the device says in later hellos)."""
    update_norm: float | None = None
    """L2 norm of the update's weights minus the model the device was sent (norm
    screening's input; None where not measured)."""

    def to_meta(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> StoredUpdate:
        try:
            return cls(
                device_id=str(meta["device_id"]),
                group=str(meta["group"]),
                round=int(meta["round"]),
                num_samples=int(meta["num_samples"]),
                message_id=str(meta["message_id"]),
                on_time=bool(meta["on_time"]),
                received_at=float(meta["received_at"]),
                metrics={str(k): float(v) for k, v in meta.get("metrics", {}).items()},
                timings={str(k): float(v) for k, v in meta.get("timings", {}).items()},
                weight_format=_weight_format(meta.get("weight_format", "float")),
                label_counts=(
                    None
                    if meta.get("label_counts") is None
                    else [int(c) for c in meta["label_counts"]]
                ),
                update_norm=_optional_float(meta.get("update_norm")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StoreError(f"corrupt update record: {exc}") from exc


@dataclass(frozen=True)
class Base:
    """A model a device was sent (``sent``) or is known to hold (``held``), as decoded."""

    round: int
    fingerprint: str
    arrays: dict[str, Array]


BaseKind = Literal["sent", "held"]


class RunState:
    """Typed access to the records of one run in a :class:`Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._updates: dict[int, set[str]] | None = None

    # -- run and registry ---------------------------------------------------------------

    def load_run(self, fingerprint: Mapping[str, Any]) -> RunMeta | None:
        """The persisted run, or None for a fresh store.

        Raises:
            StateMismatchError: the store belongs to a run with other settings, or was
                written with another state format.
        """
        meta = self.store.read_meta("run")
        if meta is None:
            return None
        found = meta.get("state_format")
        if found != STATE_FORMAT:
            written = (
                "an edgefl from before state formats were numbered"
                if found is None
                else f"state format {found!r}"
            )
            raise StateMismatchError(
                f"the state directory was written by {written}; this version reads state "
                f"format {STATE_FORMAT}: finish that run with the version that started it, "
                "or use another --state-dir"
            )
        run = RunMeta.from_meta(meta)
        if run.fingerprint != dict(fingerprint):
            differ = sorted(set(run.fingerprint) | set(fingerprint))
            changes = ", ".join(
                f"{key} {run.fingerprint.get(key)!r} -> {fingerprint.get(key)!r}"
                for key in differ
                if run.fingerprint.get(key) != fingerprint.get(key)
            )
            raise StateMismatchError(
                f"the state directory holds another run ({changes}): use another "
                "--state-dir or the same settings"
            )
        return run

    def save_run(self, run: RunMeta) -> None:
        self.store.write("run", run.to_meta())

    def save_replay(self, snapshot: Mapping[str, Any]) -> None:
        """The replay guard's memory (:meth:`coordinator.auth.ReplayGuard.snapshot`),
        written as each round closes: O(devices) once a round."""
        self.store.write("replay", {"devices": dict(snapshot)})

    def load_replay(self) -> Mapping[str, Any]:
        """What :meth:`save_replay` wrote last (empty: nothing, or unreadable)."""
        meta = self.store.read_meta("replay")
        devices = None if meta is None else meta.get("devices")
        return devices if isinstance(devices, dict) else {}

    def load_registry(self) -> dict[str, Hello]:
        """Every registered device's entry (the hello it registered with), by device id.

        Raises:
            StoreError: an entry is not a hello.
        """
        out = {}
        for key in self.store.keys("registry"):
            meta = self.store.read_meta(key)
            if meta is not None:
                device_id = key.removeprefix("registry/")
                try:
                    out[device_id] = Hello.model_validate({**meta, "device_id": device_id})
                except ValidationError as exc:
                    raise StoreError(f"corrupt registry entry {key}: {exc}") from exc
        return out

    def save_device(self, device_id: str, entry: Hello) -> None:
        """Persist one device's registry entry: its hello less the id (the key holds it)
        and the model it holds (which changes every round)."""
        meta = entry.model_dump(mode="json", exclude={"kind", "device_id", "held_base"})
        self.store.write(f"registry/{device_id}", meta)

    # -- models ------------------------------------------------------------------------

    def save_models(self, round_number: int, models: GroupModels) -> None:
        for group, roles in models.items():
            for role, arrays in roles.items():
                self.store.write(f"models/{_round_key(round_number)}/{group}/{role}", {}, arrays)

    def load_models(
        self, round_number: int, groups: Iterable[str], required: tuple[str, ...] = ("aca",)
    ) -> GroupModels:
        """Every server model round ``round_number`` starts from, by group and role.

        Raises:
            StoreError: a group lacks one of the ``required`` roles.
        """
        out: GroupModels = {}
        for group in groups:
            prefix = f"models/{_round_key(round_number)}/{group}/"
            roles = out[group] = {}
            for key in self.store.keys(prefix.rstrip("/")):
                record = self.store.read(key)
                if record is not None:
                    roles[key.removeprefix(prefix)] = record.arrays
            missing = [role for role in required if role not in roles]
            if missing:
                raise StoreError(
                    f"state is missing model(s) {missing} of group {group} in round {round_number}"
                )
        return out

    def drop_models_except(self, round_number: int) -> None:
        keep = f"models/{_round_key(round_number)}/"
        for key in self.store.keys("models"):
            if not key.startswith(keep):
                self.store.delete(key)

    # -- updates -----------------------------------------------------------------------

    @staticmethod
    def update_key(device_id: str, round_number: int) -> str:
        return f"updates/{device_id}/{_round_key(round_number)}"

    def _update_index(self) -> dict[int, set[str]]:
        """Round -> the devices with a stored update for it: an in-memory index over the
        store (the durable record), built from its keys on first use and kept by
        :meth:`put_update` and :meth:`delete_update`, so a look-up per event costs no
        store call (O(1) whatever the fleet's size)."""
        if self._updates is None:
            index: dict[int, set[str]] = {}
            for device_id, rounds in self.update_rounds().items():
                for number in rounds:
                    index.setdefault(number, set()).add(device_id)
            self._updates = index
        return self._updates

    def has_update(self, device_id: str, round_number: int) -> bool:
        return device_id in self._update_index().get(round_number, ())

    def put_update(self, update: StoredUpdate, arrays: Mapping[str, Array]) -> None:
        self.store.write(self.update_key(update.device_id, update.round), update.to_meta(), arrays)
        self._update_index().setdefault(update.round, set()).add(update.device_id)

    def read_update(
        self, device_id: str, round_number: int
    ) -> tuple[StoredUpdate, dict[str, Array]]:
        record = self.store.read(self.update_key(device_id, round_number))
        if record is None:
            raise StoreError(f"state is missing the update of {device_id} for round {round_number}")
        return StoredUpdate.from_meta(record.meta), record.arrays

    def read_update_meta(self, device_id: str, round_number: int) -> StoredUpdate:
        """The metadata of an accepted update (its weights stay in the store)."""
        meta = self.store.read_meta(self.update_key(device_id, round_number))
        if meta is None:
            raise StoreError(f"state is missing the update of {device_id} for round {round_number}")
        return StoredUpdate.from_meta(meta)

    def delete_update(self, device_id: str, round_number: int) -> None:
        self.store.delete(self.update_key(device_id, round_number))
        devices = self._update_index().get(round_number)
        if devices is not None:
            devices.discard(device_id)
            if not devices:
                del self._update_index()[round_number]

    def update_rounds(self) -> dict[str, list[int]]:
        """Device -> sorted rounds of its stored update records."""
        found: dict[str, list[int]] = {}
        for key in self.store.keys("updates"):
            _, device_id, leaf = key.split("/")
            match = _ROUND_KEY.match(leaf)
            if match:
                found.setdefault(device_id, []).append(int(match.group(1)))
        return {d: sorted(r) for d, r in found.items()}

    def round_updates(self, round_number: int) -> list[str]:
        """Devices with an accepted update for ``round_number``, sorted."""
        return sorted(self._update_index().get(round_number, ()))

    # -- screened-out devices -------------------------------------------------------------

    def screen_out(self, device_id: str, round_number: int) -> None:
        """Persist that ``device_id``'s on-time update of ``round_number`` was rejected
        for its values (one record: O(1) whatever the fleet's size)."""
        self.store.write(f"screened/{_round_key(round_number)}/{device_id}", {})

    def screened(self, round_number: int) -> set[str]:
        """The devices :meth:`screen_out` marked in ``round_number`` (a store listing:
        for a resume, not per event)."""
        prefix = f"screened/{_round_key(round_number)}"
        return {key.removeprefix(f"{prefix}/") for key in self.store.keys(prefix)}

    def drop_screened_except(self, round_number: int) -> None:
        keep = f"screened/{_round_key(round_number)}/"
        for key in self.store.keys("screened"):
            if not key.startswith(keep):
                self.store.delete(key)

    # -- per-device bases (quantized transfers) -----------------------------------------

    def save_base(self, device_id: str, kind: BaseKind, base: Base) -> None:
        meta = {"round": base.round, "fingerprint": base.fingerprint}
        self.store.write(f"bases/{device_id}/{kind}", meta, base.arrays)

    def load_base(self, device_id: str, kind: BaseKind) -> Base | None:
        record = self.store.read(f"bases/{device_id}/{kind}")
        if record is None:
            return None
        meta = record.meta
        return Base(int(meta["round"]), str(meta["fingerprint"]), record.arrays)

    def base_fingerprint(self, device_id: str, kind: BaseKind) -> str | None:
        meta = self.store.read_meta(f"bases/{device_id}/{kind}")
        return None if meta is None else str(meta["fingerprint"])

    def delete_base(self, device_id: str, kind: BaseKind) -> None:
        self.store.delete(f"bases/{device_id}/{kind}")

    # -- recovery ----------------------------------------------------------------------

    def recover(self, current_round: int, caches: Mapping[str, OcaCache]) -> None:
        """Finish what a crash interrupted (see the module docstring); idempotent.

        ``caches``: the OCA cache of each group (none: the strategy keeps no OCA).
        """
        self.drop_models_except(current_round)
        self.drop_screened_except(current_round)
        for device_id, rounds in self.update_rounds().items():
            keep = {current_round}
            if caches:
                newest = rounds[-1]
                cache = caches[self.read_update_meta(device_id, newest).group]
                if cache.slot_round(device_id) < newest:
                    log.info("recovery: folding %s round %d into the OCA", device_id, newest)
                    cache.absorb(device_id, newest)
                keep.add(cache.slot_round(device_id))
            for number in rounds:
                if number not in keep:
                    self.delete_update(device_id, number)


class OcaCache:
    """A group's OCA model: the sample-weighted average of the latest update of every
    device of the group.

    Each device's slot is its newest accepted update record in the store; this object
    holds the running float64 sum and which round of each device it contains.
    """

    def __init__(self, state: RunState, group: str) -> None:
        self._state = state
        self._key = f"oca/{group}"
        record = state.store.read(self._key)
        self._applied: dict[str, tuple[int, int]] = {}
        if record is None:
            self._sum = WeightedSum()
            return
        try:
            self._applied = {
                str(d): (int(r), int(n)) for d, (r, n) in record.meta["applied"].items()
            }
            dtypes = {k: np.dtype(v) for k, v in record.meta["dtypes"].items()}
            self._sum = WeightedSum(record.arrays, float(record.meta["weight"]), dtypes=dtypes)
        except (KeyError, TypeError, ValueError) as exc:
            raise StoreError(f"corrupt OCA record: {exc}") from exc

    @property
    def devices(self) -> int:
        """Devices with a slot."""
        return len(self._applied)

    @property
    def weight(self) -> float:
        """Total samples over the slots."""
        return self._sum.weight

    def slot_round(self, device_id: str) -> int:
        """Round of the device's update inside the sum; -1 without a slot."""
        return self._applied.get(device_id, (-1, 0))[0]

    def absorb(self, device_id: str, round_number: int) -> bool:
        """Fold the stored update ``(device_id, round_number)`` into the sum, replacing
        the device's older slot; returns False (and changes nothing) if the sum already
        holds this or a newer update of the device."""
        old_round, old_weight = self._applied.get(device_id, (-1, 0))
        if round_number <= old_round:
            return False
        update, arrays = self._state.read_update(device_id, round_number)
        old = self._state.read_update(device_id, old_round)[1] if old_round >= 0 else None
        self._sum.replace(old, old_weight, arrays, update.num_samples)
        self._applied[device_id] = (round_number, update.num_samples)
        self._save()
        if old_round >= 0:
            self._state.delete_update(device_id, old_round)
        return True

    def model(self) -> dict[str, Array]:
        """The OCA model (float32 like the updates).

        Raises:
            ValueError: the cache is empty.
        """
        return self._sum.mean()

    def _save(self) -> None:
        meta = {
            "applied": {d: list(v) for d, v in self._applied.items()},
            "weight": self._sum.weight,
            "dtypes": {k: v.str for k, v in self._sum.dtypes.items()},
        }
        self._state.store.write(self._key, meta, self._sum.sums)
