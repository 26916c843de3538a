"""DeviceRegistry: the online count the round engine checks on every event while devices
join matches the sorted online list, whatever order hellos and statuses come in."""

from __future__ import annotations

from coordinator.registry import DeviceRegistry
from coordinator.store import MemoryStore
from protocol.messages import DeviceStatus, Hello
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
    registry = DeviceRegistry({"dev-a": {"architecture": "mlp"}})

    assert len(registry) == 1
    assert registry.online() == [] and registry.online_count() == 0
