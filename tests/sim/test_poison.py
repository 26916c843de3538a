"""Attack emulation (sim.poison) and the coordinator's defences against it, end to end:
20 % of the devices upload every weight as 3.0."""

from __future__ import annotations

import numpy as np

from coordinator.config import TrainingSettings
from sim.poison import poison_weights, poisoned_devices
from sim.run import SimConfig, run_simulation

TRAINING = TrainingSettings(local_epochs=1, batch_size=16, lr=0.05)


def poisoned_run(**overrides) -> dict:
    base = {
        "devices": 10,
        "rounds": 2,
        "participation": 1.0,
        "training": TRAINING,
        "model": "mlp",
        "transport": "inproc",
        "alpha": 5.0,
        "poisoned": 0.2,
        "poison": "constant",
    }
    base.update(overrides)
    return run_simulation(SimConfig(**base)).final


def test_poisoned_devices_are_a_seeded_share() -> None:
    ids = [f"d{i}" for i in range(20)]
    chosen = poisoned_devices(ids, 0.2, seed=3)
    assert len(chosen) == 4 and chosen == poisoned_devices(ids, 0.2, seed=3)
    assert poisoned_devices(ids, 0.0, seed=3) == frozenset()


def test_poisons() -> None:
    received = {"w": np.ones(3, np.float32), "n": np.array([2])}
    trained = {"w": np.array([1.5, 1.0, 0.0], np.float32), "n": np.array([5])}
    constant = poison_weights("constant", 3.0, trained, received)
    flipped = poison_weights("sign_flip", 2.0, trained, received)
    np.testing.assert_array_equal(constant["w"], [3.0, 3.0, 3.0])
    np.testing.assert_array_equal(flipped["w"], [0.0, 1.0, 3.0])
    assert constant["n"][0] == flipped["n"][0] == 5


def test_median_keeps_the_accuracy_that_the_mean_loses() -> None:
    mean = poisoned_run(max_update_norm_ratio=0.0)  # no screening: the attack gets in
    median = poisoned_run(max_update_norm_ratio=0.0, aggregation="median")

    mean_acc = mean["models"]["aca"]["global_acc"]
    median_acc = median["models"]["aca"]["global_acc"]
    assert mean["poisoned_devices"] == 2 and mean["rejected_updates"] == 0
    assert median_acc > 40 and mean_acc < 20, (median_acc, mean_acc)  # clean run: 54 %


def test_screening_rejects_every_poisoned_update() -> None:
    final = poisoned_run()  # screening on (the default)

    assert final["rejected_updates"] == 2 * 2  # two poisoned devices, every round
    assert final["models"]["aca"]["global_acc"] > 40  # clean run: 54 %
