"""Errors of the coordinator, rooted in :class:`CoordinatorError`.

::

    CoordinatorError
    ├── ConfigError (ValueError)      bad settings: flags, TOML file, strategy options
    ├── StoreError (OSError)          the state directory cannot be read or written
    │   └── StateMismatchError        --resume with a state directory of another run
    ├── AggregationError              a round's aggregation (server-side training) failed
    ├── ReportError (coordinator.report)        a run report cannot be written or read
    ├── MetricsError (ValueError; coordinator.evaluation)   a model cannot be evaluated
    └── UpdateRejectedError (ValueError)   an update failed validation; carries a ReasonCode

``UpdateRejectedError`` never escapes the engine: it becomes an ``Ack(accepted=False)``.
"""

from __future__ import annotations

from protocol.messages import ReasonCode

__all__ = [
    "AggregationError",
    "ConfigError",
    "CoordinatorError",
    "StateMismatchError",
    "StoreError",
    "UpdateRejectedError",
]


class CoordinatorError(Exception):
    """Base class of every error the coordinator raises."""


class ConfigError(CoordinatorError, ValueError):
    """Invalid configuration (flags, TOML file, strategy or model options)."""


class StoreError(CoordinatorError, OSError):
    """The state store could not be read or written, or holds corrupt data."""


class StateMismatchError(StoreError):
    """``--resume`` pointed at a state directory written by a different configuration."""


class AggregationError(CoordinatorError):
    """A round's aggregation failed (a strategy's server step raised). The round stays
    open in the state store; a resumed coordinator runs the aggregation again."""


class UpdateRejectedError(CoordinatorError, ValueError):
    """An update (or hello) failed validation.

    Attributes:
        reason: the :class:`~protocol.messages.ReasonCode` sent back in the Ack.
    """

    def __init__(self, reason: ReasonCode, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
