"""Which selected devices a round still waits for: those heard from since it started.

A selected device that has sent nothing during its round (no status such as
``training``, no hello, no update), or whose last word was that it went offline (its
status or last will), while every other one it heard from has answered is *silent*:
after ``--silent-grace`` seconds from the last answer the round closes without it
(docs/protocol.md, section 9, step 7). O(1) per message and per tick.
"""

from __future__ import annotations

import logging

__all__ = ["ONLINE_LOG_EACH", "ONLINE_LOG_S", "WAITING_LOG_S", "RoundLiveness", "WaitingLog"]

log = logging.getLogger("coordinator.engine")  # the round engine's lines, as they always were

WAITING_LOG_S = 60.0
"""While too few devices are online, the log says why no round starts this often."""
ONLINE_LOG_EACH = 10
"""While a round waits for devices, each change of the online count up to this many
devices is logged ("2 of 3 online")."""
ONLINE_LOG_S = 1.0
"""Beyond :data:`ONLINE_LOG_EACH` online devices, changes are logged at most this often
(the latest count), so that thousands of devices joining give a line a second."""


class RoundLiveness:
    """The heard and answered devices of the open round.

    Args:
        grace_s: seconds after the last answer before silent devices are dropped (0: never).
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._heard: set[str] = set()
        self._waiting: set[str] = set()
        """Heard and not answered yet: the round waits for them."""
        self.last_answer_at = 0.0
        """When the last selected device answered (or the round, or the engine, started)."""

    def new_round(self, now: float) -> None:
        """A round starts at ``now`` (or the engine resumes one): nobody heard yet."""
        self._heard, self._waiting, self.last_answer_at = set(), set(), now

    def heard(self, device_id: str, answered: bool) -> None:
        """A selected device sent something this round (``answered``: it has answered)."""
        if device_id not in self._heard:
            self._heard.add(device_id)
            if not answered:
                self._waiting.add(device_id)

    def gone(self, device_id: str) -> None:
        """A selected device said it went offline (its status or last will): the round
        no longer waits for it, as if silent, until it sends something again."""
        self._heard.discard(device_id)
        self._waiting.discard(device_id)

    def answered(self, device_id: str, now: float) -> None:
        """A selected device answered its task at ``now``."""
        self._waiting.discard(device_id)
        self.last_answer_at = now

    def silent_only(self, now: float, answered: int, selected: int) -> bool:
        """Whether the devices the round still waits for are all silent and the grace
        since the last answer has passed (``answered`` of ``selected`` have)."""
        return (
            self.grace_s > 0
            and answered > 0
            and not self._waiting
            and answered < selected
            and now >= self.last_answer_at + self.grace_s
        )


class WaitingLog:
    """What the log says while a round waits for ``min_devices`` online devices: each
    change of the online count ("round 1: 2 of 3 online"), every change while at most
    :data:`ONLINE_LOG_EACH` are online, then at most once per :data:`ONLINE_LOG_S`; and
    every :data:`WAITING_LOG_S` why no round starts. O(1) per call."""

    def __init__(self, min_devices: int) -> None:
        self.min_devices = min_devices
        self._reminded_at = -WAITING_LOG_S
        self._said: tuple[int, int] | None = None
        """(round, online count) the log last said."""
        self._said_at = -ONLINE_LOG_S

    def waiting(self, now: float, round_number: int, online: int, registered: int) -> None:
        """Round ``round_number`` still waits at ``now`` with ``online`` of ``registered``
        devices online."""
        said = self._said or (round_number, 0)  # 0 at a start: the reminder says it
        if said != (round_number, online) and (
            online <= ONLINE_LOG_EACH or now >= self._said_at + ONLINE_LOG_S
        ):  # as devices join (or leave): each change while few, then once a second
            self._said, self._said_at = (round_number, online), now
            log.info(
                "round %d: %d of %d online (--min-devices)", round_number, online, self.min_devices
            )
        if now >= self._reminded_at + WAITING_LOG_S:
            self._reminded_at = now
            log.info(
                "round %d waits for %d online device(s) (--min-devices): %d of %d "
                "registered online; a device comes online with its next hello or status",
                round_number,
                self.min_devices,
                online,
                registered,
            )
