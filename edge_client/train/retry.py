"""How a device retries its update, as data: one schedule for the session and every shell.

Two rules, both about the update of a round:

* **Publishing** (the shell's :class:`~edge_client.train.shell.Upload`): while the broker
  is unreachable the update is published again after ``first_delay_s``, the delay
  doubling up to ``max_delay_s``, until ``upload_deadline_s`` after the first attempt
  would pass; an encoding error or the device stopping gives up at once.
* **Acknowledgement** (the :class:`~edge_client.train.session.DeviceSession`): an update
  published waits ``ack_timeout_s`` for the coordinator's ack and is sent again (the very
  same message) at most ``max_resends`` times.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_client.config import ClientConfig

__all__ = ["RetrySchedule"]


@dataclass(frozen=True)
class RetrySchedule:
    """A device's retry timings (seconds) and counts; :meth:`of` reads a device's."""

    upload_deadline_s: float
    """Publishing attempts stop once the next would start this long after the first."""
    ack_timeout_s: float
    """How long an update published waits for the coordinator's ack."""
    max_resends: int
    """Times an update without an ack (or with a retryable nack) is sent again, at most."""
    first_delay_s: float = 0.5
    """Wait after the first failed publishing attempt."""
    max_delay_s: float = 10.0
    """Longest wait between publishing attempts (the wait doubles up to it)."""

    @classmethod
    def of(cls, config: ClientConfig) -> RetrySchedule:
        """The schedule of the device ``config`` describes."""
        return cls(
            upload_deadline_s=config.upload_retry_s,
            ack_timeout_s=config.ack_timeout_s,
            max_resends=config.max_resends,
        )

    def next_delay(self, delay_s: float) -> float:
        """The wait after the one of ``delay_s`` seconds."""
        return min(delay_s * 2, self.max_delay_s)
