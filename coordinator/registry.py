"""The device registry: who announced itself (hello) and who is online (status / will).

An entry is the device's :class:`~protocol.messages.Hello`, typed as it came off the wire,
less the model the device holds (``held_base``: it changes every round and lives with the
transfers). Entries are persisted (:meth:`coordinator.state.RunState.save_device`);
online flags come from the devices' retained status messages and last wills, which the
broker replays on (re)subscribe, and from their hellos and updates (any fresh frame of a
device brings it back online), so they are kept in memory only.
"""

from __future__ import annotations

from collections.abc import Mapping

from protocol.messages import DeviceStatus, Hello

__all__ = ["DeviceRegistry"]

_OFFLINE_STATES = frozenset({"offline"})


def _entry(hello: Hello) -> Hello:
    """What is kept of a hello: all of it but the model the device holds."""
    return hello if hello.held_base is None else hello.model_copy(update={"held_base": None})


class DeviceRegistry:
    """Registered devices (persistent entries) and the online subset (in memory)."""

    def __init__(self, entries: Mapping[str, Hello] | None = None) -> None:
        self._entries: dict[str, Hello] = {k: _entry(v) for k, v in (entries or {}).items()}
        self._online: set[str] = set()

    def __contains__(self, device_id: object) -> bool:
        return device_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, device_id: str) -> Hello:
        """The hello ``device_id`` registered with.

        Raises:
            KeyError: the device is not registered.
        """
        return self._entries[device_id]

    @property
    def entries(self) -> dict[str, Hello]:
        """Device id -> the hello it registered with (a copy of the mapping; hellos are
        frozen)."""
        return dict(self._entries)

    def get(self, device_id: str) -> Hello | None:
        """The hello ``device_id`` registered with; None if it did not."""
        return self._entries.get(device_id)

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

    def heard(self, device_id: str) -> None:
        """A fresh, authenticated frame other than a status came from ``device_id``
        (its update): a registered device that sends one is online, whatever status was
        taken last (a lost ``online`` or a stale ``offline`` must not keep it out)."""
        if device_id in self._entries:
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
