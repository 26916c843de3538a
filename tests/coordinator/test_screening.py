"""Update screening (coordinator.screening) and robust aggregation (coordinator.averaging):
the known attack (every weight 3.0) is rejected with ``update_norm``, decisions survive a
crash, and the coordinate-wise aggregates match numpy."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from coordinator.actions import Finished, RoundClosed
from coordinator.averaging import CoordinateWise, accumulator
from coordinator.engine import RoundEngine
from coordinator.errors import ConfigError
from coordinator.events import Received
from coordinator.screening import NormScreen, delta_norm, model_norm
from coordinator.store import FileStore, MemoryStore
from coordinator.strategies.registry import build_strategy
from protocol.messages import Ack, Message, ReasonCode
from tests.coordinator.helpers import (
    GROUP,
    config,
    hello,
    make_engine,
    published,
    received,
    templates,
    update,
)
from tests.coordinator.test_crash import CrashingStore, SimulatedCrashError

DEVICES = ("dev-0", "dev-1", "dev-2")


def screened(**overrides: object):
    """The helpers' config with norm screening on (they turn it off)."""
    return config(max_update_norm_ratio=10.0, **overrides)


def moved(model: dict[str, np.ndarray], norm: float, seed: int) -> dict[str, np.ndarray]:
    """``model`` plus a random delta of L2 norm ``norm``."""
    rng = np.random.default_rng(seed)
    delta = {k: rng.normal(size=v.shape) for k, v in model.items()}
    scale = norm / np.sqrt(sum(float((d**2).sum()) for d in delta.values()))
    return {k: (v + scale * delta[k]).astype(v.dtype) for k, v in model.items()}


def acks(actions: list) -> list[Ack]:
    return [a.message.body for a in published(actions, "ack")]


# -- coordinate-wise aggregates ---------------------------------------------------------


def hand_made(k: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(k)
    return [
        {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=5)} for _ in range(k)
    ]


@pytest.mark.parametrize("k", [1, 4, 5])
def test_median_matches_numpy(k: int) -> None:
    updates = hand_made(k)
    acc = CoordinateWise("median")
    for i, u in enumerate(updates):
        acc.add(u, weight=10 * (i + 1))  # weights do not count

    out = acc.mean()

    for name in ("w", "b"):
        expected = np.median(np.stack([u[name] for u in updates]).astype(np.float64), axis=0)
        np.testing.assert_allclose(out[name], expected, rtol=1e-6)
        assert out[name].dtype == updates[0][name].dtype
    assert acc.weight == sum(10 * (i + 1) for i in range(k))


@pytest.mark.parametrize(
    ("k", "fraction", "cut"), [(5, 0.2, 1), (10, 0.2, 2), (4, 0.2, 0), (7, 0.45, 3)]
)
def test_trimmed_mean_matches_numpy(k: int, fraction: float, cut: int) -> None:
    updates = hand_made(k)
    acc = CoordinateWise("trimmed_mean", fraction)
    for u in updates:
        acc.add(u, weight=1.0)

    out = acc.mean()

    for name in ("w", "b"):
        ordered = np.sort(np.stack([u[name] for u in updates]).astype(np.float64), axis=0)
        np.testing.assert_allclose(out[name], ordered[cut : k - cut].mean(0), rtol=1e-6)


def test_one_wild_update_moves_the_median_not_at_all_and_the_mean_a_lot() -> None:
    updates = [{"w": np.full(3, v, np.float32)} for v in (1.0, 1.1, 0.9, 1.05)]
    attack = {"w": np.full(3, 3.0e6, np.float32)}
    median, trimmed, mean = accumulator("median"), accumulator("trimmed_mean"), accumulator("mean")
    for acc in (median, trimmed, mean):
        for u in [*updates, attack]:
            acc.add(u, 100)

    assert np.allclose(median.mean()["w"], 1.05)
    assert np.allclose(trimmed.mean()["w"], (1.0 + 1.1 + 1.05) / 3)
    assert mean.mean()["w"][0] > 1e5


def test_integer_tensors_are_rounded_like_the_mean() -> None:
    acc = CoordinateWise("median")
    for v in (1, 2, 4):
        acc.add({"n": np.array([v], np.int64)}, 1)

    assert acc.mean()["n"].dtype == np.int64 and acc.mean()["n"][0] == 2


def test_strategies_that_distil_refuse_robust_aggregation() -> None:
    cfg = config(strategy="feddf", aggregation="median")
    with pytest.raises(ConfigError, match="not supported"):
        build_strategy(cfg, templates(cfg))
    for name in ("fedavg", "fedprox", "fedavg_oca", "fedkf"):
        cfg = config(strategy=name, aggregation="trimmed_mean")
        build_strategy(cfg, templates(cfg))  # no error


# -- norm screening ---------------------------------------------------------------------


def test_screen_reference_is_the_round_median_floored_by_the_previous_round() -> None:
    screen = NormScreen(ratio=10.0, cap=None, floor=None)
    assert screen.reference(sent_norm=7.0) == 7.0  # nothing known yet: the model's norm
    for norm in (1.0, 3.0, 2.0):
        screen.accepted(norm)
    assert screen.reference(7.0) == 2.0
    screen.new_round(floor=screen.next_floor())
    screen.accepted(0.5)
    assert screen.reference(7.0) == 2.0  # max(floor 2, median 0.5)
    screen.check(19.9, 7.0)
    assert screen.reference(sent_norm=70.0) == 7.0  # never below a tenth of the model
    with pytest.raises(Exception, match="update_norm"):
        screen.check(20.1, 7.0)


def test_absolute_cap() -> None:
    screen = NormScreen(ratio=0.0, cap=5.0, floor=None)
    screen.check(4.9, 1.0)
    with pytest.raises(Exception, match="cap"):
        screen.check(5.1, 1.0)


def started(cfg) -> tuple[RoundEngine, MemoryStore, dict[str, np.ndarray]]:
    store = MemoryStore()
    engine = make_engine(cfg, store)
    engine.start(0.0)
    for d in DEVICES:
        engine.handle(received(hello(engine, d, samples=100), 1.0))
    return engine, store, engine.models()[GROUP]["aca"]


@pytest.mark.parametrize("attacker_first", [True, False])
def test_the_all_three_update_is_rejected_and_the_model_keeps_only_the_honest(
    attacker_first: bool,
) -> None:
    engine, store, w0 = started(screened(rounds=1, min_devices=3))
    attack = {k: np.full_like(v, 3.0) for k, v in w0.items()}
    honest = {d: moved(w0, 0.5, i) for i, d in enumerate(DEVICES) if d != "dev-1"}
    order = ["dev-1", "dev-0", "dev-2"] if attacker_first else ["dev-0", "dev-2", "dev-1"]

    results = {}
    closed = []
    for t, d in enumerate(order):
        weights = attack if d == "dev-1" else honest[d]
        actions = engine.handle(received(update(d, 1, weights, 100), 5.0 + t))
        results[d] = acks(actions)[0]
        closed += [a for a in actions if isinstance(a, RoundClosed)]

    assert not results["dev-1"].accepted and results["dev-1"].reason is ReasonCode.UPDATE_NORM
    assert results["dev-0"].accepted and results["dev-2"].accepted
    assert not store.exists("updates/dev-1/r000001")
    assert len(closed) == 1 and closed[0].on_time == 2 and closed[0].rejected == 1
    final = engine.models()[GROUP]["aca"]  # the round closed without waiting for dev-1
    for k in final:
        np.testing.assert_allclose(
            final[k], (honest["dev-0"][k] + honest["dev-2"][k]) / 2, atol=1e-6
        )
        assert np.abs(final[k]).max() < 3.0


def test_screening_off_takes_the_attack() -> None:
    engine, _, w0 = started(config(rounds=1, min_devices=3))  # ratio 0: off
    attack = {k: np.full_like(v, 3.0) for k, v in w0.items()}

    ack = acks(engine.handle(received(update("dev-1", 1, attack, 100), 5.0)))[0]

    assert ack.accepted


# -- screening decisions survive a crash ------------------------------------------------


@dataclass(frozen=True)
class Step:
    device: str
    round: int
    norm: float | None  # None: every weight 3.0
    samples: int


STEPS = [  # (the model's norm is ~12: the reference is at least 1.2)
    # round 1: nothing known, then the round's median (dev-2 at 80 > 10 x 7.5)
    Step("dev-0", 1, 5.0, 40),
    Step("dev-1", 1, None, 40),
    Step("dev-1", 1, 10.0, 60),  # a second, honest upload of the device is taken
    Step("dev-2", 1, 80.0, 50),  # rejected: the round closes (every device answered)
    # round 2: the floor (round 1's median 7.5) judges the first update
    Step("dev-2", 2, 90.0, 50),
    Step("dev-2", 2, 6.0, 50),
    Step("dev-0", 2, 10.0, 40),
    Step("dev-1", 2, 20.0, 60),
]


def event(engine: RoundEngine, index: int) -> Received:
    """Step ``index`` as an update against the engine's current model."""
    step = STEPS[index]
    model = engine.models()[GROUP]["aca"]
    if step.norm is None:
        weights = {k: np.full_like(v, 3.0) for k, v in model.items()}
    else:
        weights = moved(model, step.norm, 100 + index)
    message = update(step.device, step.round, weights, step.samples)
    message = Message(**{**message.model_dump(), "message_id": f"{index:032x}"})
    return Received(step.device, message, 10.0 + index)


def decisions(actions: list) -> dict[str, tuple[bool, str]]:
    return {a.ref: (a.accepted, a.reason.value) for a in acks(actions)}


def run_steps(engine: RoundEngine, start: int, seen: dict, on_event=None) -> Finished | None:
    finished = None
    for index in range(start, len(STEPS)):
        if on_event is not None:
            on_event(index)
        actions = engine.handle(event(engine, index))
        seen.update(decisions(actions))
        finished = next((a for a in actions if isinstance(a, Finished)), finished)
    return finished


def begin(engine: RoundEngine, now: float) -> list:
    actions = engine.start(0.0)
    for d in DEVICES:
        actions += engine.handle(received(hello(engine, d, samples=100), now))
    return actions


def test_screening_decisions_are_the_same_after_a_crash_at_any_write(tmp_path: Path) -> None:
    cfg = screened(rounds=2, min_devices=3, state_dir=tmp_path / "reference")
    counting = CrashingStore(FileStore(tmp_path / "reference"), crash_at=None)
    engine = make_engine(cfg, counting)
    begin(engine, 1.0)
    expected: dict[str, tuple[bool, str]] = {}
    finished = run_steps(engine, 0, expected)
    assert finished is not None
    assert [expected[f"{i:032x}"] for i in range(len(STEPS))] == [
        (True, "ok"),
        (False, "update_norm"),
        (True, "ok"),
        (False, "update_norm"),
        (False, "update_norm"),
        (True, "ok"),
        (True, "ok"),
        (True, "ok"),
    ]
    total = counting.mutations

    for crash_at in range(1, total + 1):
        directory = tmp_path / f"crash-{crash_at}"
        cfg_k = cfg.model_copy(update={"state_dir": directory})
        crashing = make_engine(cfg_k, CrashingStore(FileStore(directory), crash_at))
        seen: dict[str, tuple[bool, str]] = {}
        position = {"at": 0}
        try:
            begin(crashing, 1.0)
            run_steps(crashing, 0, seen, on_event=functools.partial(position.__setitem__, "at"))
        except SimulatedCrashError:
            pass
        resumed = make_engine(cfg_k.model_copy(update={"resume": True}), FileStore(directory))
        at_start = begin(resumed, 9.0)  # the devices say hello again
        finished = run_steps(resumed, position["at"], seen)
        finished = finished or next((a for a in at_start if isinstance(a, Finished)), None)
        interrupted = f"{position['at']:032x}"
        if seen[interrupted] == (False, "late") or (
            seen[interrupted] == (True, "duplicate") and expected[interrupted] == (True, "ok")
        ):
            # it closed the round and the crash came after the round's commit point: its
            # resend (the Ack was lost) finds the round closed; one the round counted is
            # acknowledged as such (duplicate), one it screened out is refused late
            seen[interrupted] = expected[interrupted]
        assert seen == expected, f"crash at write {crash_at}"
        assert finished is not None
        for k, v in finished.models[GROUP]["aca"].items():
            np.testing.assert_allclose(v, engine.models()[GROUP]["aca"][k], atol=1e-6)


def test_delta_norm_counts_every_tensor() -> None:
    # an integer buffer moves the model too: it is measured, not skipped
    a = {"w": np.array([3.0, 4.0], np.float32), "n": np.array([12], np.int64)}
    b = {"w": np.zeros(2, np.float32), "n": np.array([0], np.int64)}
    assert delta_norm(a, b) == pytest.approx(13.0)
    assert model_norm(a) == pytest.approx(13.0)
    assert model_norm(a, {"w"}) == pytest.approx(5.0)


# -- flags of both command lines --------------------------------------------------------

FLAGS = (
    "--max-update-norm-ratio", "5", "--max-update-norm", "100",
    "--aggregation", "trimmed_mean", "--trim-fraction", "0.1",
)  # fmt: skip


def test_flags_of_the_coordinator() -> None:
    from coordinator.__main__ import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["--embedded-broker", *FLAGS]))
    assert (cfg.max_update_norm_ratio, cfg.max_update_norm) == (5.0, 100.0)
    assert (cfg.aggregation, cfg.trim_fraction) == ("trimmed_mean", 0.1)
    default = config_from_args(build_parser().parse_args(["--embedded-broker"]))
    assert default.max_update_norm_ratio == 10.0 and default.aggregation == "mean"


def test_flags_of_the_sim_reach_its_coordinator() -> None:
    from sim.__main__ import build_parser
    from sim.run_cli import sim_config

    attack = ["--poisoned", "0.2", "--poison", "sign_flip", "--poison-scale", "5"]
    sim = sim_config(build_parser().parse_args(["run", *FLAGS, *attack]))
    assert (sim.poisoned, sim.poison, sim.poison_scale) == (0.2, "sign_flip", 5.0)
    cfg = sim.coordinator_config(10, (1, 28, 28))
    assert (cfg.max_update_norm_ratio, cfg.max_update_norm) == (5.0, 100.0)
    assert (cfg.aggregation, cfg.trim_fraction) == ("trimmed_mean", 0.1)


def test_a_resumed_round_does_not_wait_for_a_device_it_screened_out(tmp_path: Path) -> None:
    """The screened-out set is part of the run record: after a crash, the round closes
    on the last honest update, not at its deadline."""
    cfg = screened(rounds=1, min_devices=3, state_dir=tmp_path)
    engine = make_engine(cfg, FileStore(tmp_path))
    begin(engine, 1.0)
    w0 = engine.models()[GROUP]["aca"]
    attack = {k: np.full_like(v, 3.0) for k, v in w0.items()}
    first = acks(engine.handle(received(update("dev-1", 1, attack, 100), 5.0)))
    engine.handle(received(update("dev-0", 1, moved(w0, 0.5, 0), 100), 6.0))
    assert first[0].reason is ReasonCode.UPDATE_NORM
    del engine  # a crash: nothing more is written

    resumed = make_engine(cfg.model_copy(update={"resume": True}), FileStore(tmp_path))
    begin(resumed, 9.0)
    actions = resumed.handle(received(update("dev-2", 1, moved(w0, 0.5, 2), 100), 10.0))

    closed = [a for a in actions if isinstance(a, RoundClosed)]
    assert len(closed) == 1 and closed[0].on_time == 2  # dev-0 and dev-2; dev-1 not awaited
