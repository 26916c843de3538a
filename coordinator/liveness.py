"""Which selected devices a round still waits for: those heard from since it started.

A selected device that has sent nothing during its round (no status such as
``training``, no hello, no update), or whose last word was that it went offline (its
status or last will), while every other one it heard from has answered is *silent*:
after ``--silent-grace`` seconds from the last answer the round closes without it
(docs/protocol.md, section 9, step 7). O(1) per message and per tick.
"""

from __future__ import annotations

__all__ = ["RoundLiveness"]


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
