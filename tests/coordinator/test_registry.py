"""DeviceRegistry: the online count the round engine checks on every event while devices
join matches the sorted online list, whatever order hellos and statuses come in; an entry
is the device's hello, typed, and the state store keeps it."""

from __future__ import annotations

import pytest

from coordinator.errors import StoreError
from coordinator.registry import DeviceRegistry
from coordinator.state import RunState
from coordinator.store import MemoryStore
from protocol.messages import DeviceStatus, Hello
from protocol.tensors import Precision
from tests.coordinator.helpers import config, hello, make_engine


def test_online_count_follows_hellos_statuses_and_unknown_devices() -> None:
    engine = make_engine(config(), MemoryStore())
    registry = DeviceRegistry()

    registry.set_status("dev-c", DeviceStatus(state="online"))  # unknown: ignored
    for device_id in ("dev-b", "dev-a"):
        body = hello(engine, device_id).body
        assert isinstance(body, Hello)
        registry.register(body)
    registry.set_status("dev-b", DeviceStatus(state="offline"))
    registry.set_status("dev-b", DeviceStatus(state="offline"))  # twice: still one device

    assert registry.online() == ["dev-a"]
    assert registry.online_count() == 1
    registry.set_status("dev-b", DeviceStatus(state="idle"))
    assert registry.online() == ["dev-a", "dev-b"] and registry.online_count() == 2


def test_registry_restored_from_the_store_starts_with_nobody_online() -> None:
    body = hello(make_engine(config(), MemoryStore()), "dev-a").body
    assert isinstance(body, Hello)
    registry = DeviceRegistry({"dev-a": body})

    assert len(registry) == 1
    assert registry.online() == [] and registry.online_count() == 0


def test_an_entry_is_the_typed_hello_less_the_model_held_and_the_store_keeps_it() -> None:
    engine = make_engine(config(), MemoryStore())
    body = hello(
        engine, "dev-a", held_base="0123456789abcdef", uplink_precision=Precision.FP32
    ).body
    assert isinstance(body, Hello)
    registry, state = DeviceRegistry(), RunState(MemoryStore())

    assert registry.register(body) and not registry.register(body)  # unchanged: no save
    entry = registry["dev-a"]
    state.save_device("dev-a", entry)

    assert entry == body.model_copy(update={"held_base": None})
    assert entry.uplink_precision is Precision.FP32 and entry.downlink_precision is None
    assert state.load_registry() == {"dev-a": entry}
    record = state.store.read_meta("registry/dev-a")
    assert record is not None and "held_base" not in record and "device_id" not in record
    assert record["uplink_precision"] == "fp32" and "weight_format" not in record


def test_a_corrupt_registry_record_is_a_store_error() -> None:
    state = RunState(MemoryStore())
    state.store.write("registry/dev-a", {"architecture": "mlp"})

    with pytest.raises(StoreError, match="registry/dev-a"):
        state.load_registry()
