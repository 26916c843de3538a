"""The device registry: who announced itself (hello) and who is online (status / will).

Entries come from hello messages and are persisted; online flags come from the devices'
retained status messages and last wills, which the broker replays on (re)subscribe, so
they are kept in memory only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from protocol.messages import DeviceStatus, Hello

__all__ = ["DeviceRegistry"]

_OFFLINE_STATES = frozenset({"offline"})


def _entry(hello: Hello) -> dict[str, Any]:
    """What is kept of a hello: everything but the id and the model the device holds
    (which changes every round and lives with the transfers)."""
    return hello.model_dump(mode="json", exclude={"kind", "device_id", "held_base"})


class DeviceRegistry:
    """Registered devices (persistent entries) and the online subset (in memory)."""

    def __init__(self, entries: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self._entries: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (entries or {}).items()}
        self._online: set[str] = set()

    def __contains__(self, device_id: object) -> bool:
        return device_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> dict[str, dict[str, Any]]:
        """Device id -> its announced properties (a copy)."""
        return {k: dict(v) for k, v in self._entries.items()}

    def get(self, device_id: str) -> dict[str, Any] | None:
        entry = self._entries.get(device_id)
        return None if entry is None else dict(entry)

    def register(self, hello: Hello) -> bool:
        """Add or refresh the device of ``hello`` and mark it online.

        Returns True when the persistent entry changed (so it needs saving).
        """
        entry = _entry(hello)
        changed = self._entries.get(hello.device_id) != entry
        self._entries[hello.device_id] = entry
        self._online.add(hello.device_id)
        return changed

    def set_status(self, device_id: str, status: DeviceStatus) -> None:
        """Apply a device's status (online/idle/training/... or offline); unknown devices
        are ignored until they say hello."""
        if device_id not in self._entries:
            return
        if status.state in _OFFLINE_STATES:
            self._online.discard(device_id)
        else:
            self._online.add(device_id)

    def online(self) -> list[str]:
        """Registered devices currently online, sorted (O(n log n): for a round's
        selection; :meth:`online_count` to compare with a threshold)."""
        return sorted(self._online)

    def online_count(self) -> int:
        """How many registered devices are online, in O(1): only registered devices are
        ever marked online (an unknown device's status is ignored) and entries are never
        removed, so the online set holds registered devices only."""
        return len(self._online)
