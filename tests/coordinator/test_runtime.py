"""The coordinator runtime over the in-memory broker: bad input on the fleet's topics."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from coordinator.runtime import Coordinator
from coordinator.store import MemoryStore
from protocol.channel import Channel
from protocol.messages import Message
from protocol.tensors import Precision
from protocol.tensorset import encode_tensors
from protocol.topics import Topics
from protocol.transport import MemoryBroker, MemoryTransport
from tests.coordinator.helpers import (
    FLEET,
    config,
    hello,
    make_engine,
    shapes_of,
    update,
)


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_malformed_and_foreign_messages_change_nothing() -> None:
    broker, store = MemoryBroker(), MemoryStore()
    cfg = config(min_devices=1, rounds=1)
    coordinator = Coordinator(cfg, MemoryTransport(broker, "coordinator"), store, tick_s=0.02)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    assert wait_for(lambda: store.read_meta("run") is not None)
    initial = store.snapshot()
    attacker = MemoryTransport(broker, "attacker")
    attacker.connect()
    channel = Channel(attacker)
    topics = Topics(FLEET)
    engine = make_engine(cfg, MemoryStore())
    weights = {k: np.zeros(s, np.float32) for k, s in shapes_of(engine).items()}
    good_hello = hello(engine, "dev-0")

    attacker.publish(topics.device("dev-0", "update"), b"\x00garbage")
    attacker.publish(topics.device("dev-0", "hello"), b"FL\x07\x01" + b"\xff" * 72)
    channel.send(topics.device("dev-1", "hello"), good_hello)  # sender != topic device
    channel.send(
        topics.device("dev-0", "hello"),
        Message(fleet="elsewhere", sender="dev-0", body=good_hello.body),
    )
    channel.send(
        topics.device("dev-0", "update"), update("dev-0", 1, weights, 10)
    )  # unknown device
    nan = {**weights, "head.bias": np.full_like(weights["head.bias"], np.nan)}
    bad = update("dev-0", 1, weights, 10).body.model_copy(
        update={"sets": {"weights": encode_tensors(nan, Precision.FP32)}}
    )
    channel.send(
        topics.device("dev-0", "update"), Message(fleet=FLEET, sender="dev-0", round=1, body=bad)
    )
    channel.send(topics.to_device("dev-0", "task"), good_hello)  # a downlink topic: not for us
    time.sleep(0.3)
    assert coordinator.transport.flush(5)

    kept = initial.keys()
    assert store.keys() == kept
    for key in kept:
        assert store.read_meta(key) == initial.read_meta(key)
    assert len(coordinator.engine.registry) == 0
    assert thread.is_alive()  # still serving
    coordinator.stop()
    thread.join(5)
    attacker.disconnect()


def test_a_run_survives_a_broker_restart_mid_round() -> None:
    from edge_client.config import ClientConfig
    from edge_client.train.data import DeviceData
    from edge_client.train.runtime import EdgeClient
    from sim.datasets import load_dataset
    from sim.partition import partition_dataset

    broker, store = MemoryBroker(), MemoryStore()
    cfg = config(min_devices=2, rounds=3, participation=1.0, round_timeout_s=60.0)
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"local_steps": 2})})
    coordinator = Coordinator(cfg, MemoryTransport(broker, "coordinator"), store, tick_s=0.02)
    closed: list[int] = []
    restarted = threading.Event()

    def restart_during_round_2(action) -> None:
        from coordinator.actions import RoundStarted

        if isinstance(action, RoundStarted) and action.round == 2 and not restarted.is_set():
            restarted.set()
            threading.Thread(
                target=lambda: (broker.stop(), time.sleep(0.2), broker.start())
            ).start()

    coordinator.add_observer(restart_during_round_2)
    coordinator.add_observer(lambda a: closed.append(a.round) if hasattr(a, "on_time") else None)
    federation = partition_dataset(
        load_dataset("synthetic", seed=0, train_samples=400), 2, float("inf"), seed=0
    )
    clients = []
    for split in federation.devices:
        data = DeviceData(
            split.device_id, split.train.x, split.train.y, split.test.x, split.test.y, 10
        )
        client_config = ClientConfig(
            device_id=split.device_id,
            fleet=FLEET,
            model="mlp",
            exit_when_finished=True,
            insecure_no_auth=True,
        )
        clients.append(EdgeClient(client_config, MemoryTransport(broker, split.device_id), data))
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    for client in clients:
        client.start()

    thread.join(60)

    assert not thread.is_alive()
    assert restarted.is_set()
    assert coordinator.final_models is not None
    assert closed == [1, 2, 3]
    for client in clients:
        client.stop()


def test_a_rounds_fan_out_is_sent_side_by_side_each_device_in_order() -> None:
    """The model and task of each of 12 devices go out on the sender threads (one per
    core), each device's model before its task, and every Publish is observed on the
    engine thread in the engine's order, after it was sent."""
    devices = [f"dev-{i:02d}" for i in range(12)]
    broker, store = MemoryBroker(), MemoryStore()
    cfg = config(min_devices=len(devices), rounds=1)
    coordinator = Coordinator(cfg, MemoryTransport(broker, "coordinator"), store, tick_s=0.02)
    topics = Topics(FLEET)
    arrived: dict[str, list[str]] = {d: [] for d in devices}
    lock = threading.Lock()

    def on_downlink(message) -> None:
        device, leaf = message.topic.split("/")[-2:]
        with lock:
            arrived[device].append(leaf)

    listener = MemoryTransport(broker, "listener")
    listener.connect()
    for device in devices:
        for leaf in ("model", "task"):
            listener.subscribe(topics.to_device(device, leaf), on_downlink)
    senders: dict[str, set[str]] = {d: set() for d in devices}
    publish = coordinator._publish

    def recording_publish(action) -> None:
        device = action.topic.split("/")[-2]
        if device in senders and action.topic.endswith(("/model", "/task")):
            senders[device].add(threading.current_thread().name)
        publish(action)

    coordinator._publish = recording_publish  # type: ignore[method-assign]
    observed: list[tuple[str, str]] = []

    def observe(action) -> None:
        from coordinator.actions import Publish

        if isinstance(action, Publish) and action.topic.endswith(("/model", "/task")):
            device, leaf = action.topic.split("/")[-2:]
            observed.append((device, leaf))

    coordinator.add_observer(observe)
    thread = threading.Thread(target=coordinator.run, daemon=True)
    thread.start()
    assert wait_for(lambda: store.read_meta("run") is not None)
    channel = Channel(MemoryTransport(broker, "fleet"))
    channel.transport.connect()
    engine = make_engine(cfg, MemoryStore())
    for device in devices:
        channel.send(topics.device(device, "hello"), hello(engine, device))
    assert wait_for(lambda: all("task" in arrived[d] for d in devices))
    assert wait_for(lambda: len(observed) == 2 * len(devices))
    coordinator.stop()
    thread.join(10)

    for device in devices:
        leaves = arrived[device]  # the model's chunks, then the task
        assert leaves[-1] == "task" and set(leaves[:-1]) == {"model"}, (device, leaves)
        assert observed.index((device, "model")) < observed.index((device, "task"))
    names = set().union(*senders.values())
    if len(os.sched_getaffinity(0)) > 1:
        assert all(name.startswith("coordinator-send") for name in names), names
        assert len(names) > 1, names
    else:  # one core: sent in place, on the engine thread
        assert len(names) == 1, names
