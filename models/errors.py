"""Errors raised by the `models` package.

Every error the package raises derives from :class:`ModelError`; pydantic validation
errors from model configurations are converted where they occur and never escape raw::

    ModelError
    ├── UnknownModelError (also KeyError)     a classifier or generator name is not
    │                                          registered; the message lists known names.
    ├── ModelConfigError (also ValueError)    an option or configuration value is invalid
    │                                          (unknown option, wrong type, out of range).
    ├── ModelInputError (also ValueError)     an argument does not fit the model: a state
    │                                          subset the module has not, an input tensor
    │                                          of the wrong shape.
    ├── StateMismatchError (also ValueError)  a set of arrays does not match a module's
    │                                          state: missing or unexpected names, shape
    │                                          mismatches, non-numeric or non-finite
    │                                          values. The module is left unchanged.
    └── DataFileError (also ValueError)       a dataset file is missing, truncated or
                                               malformed (models.datafiles); the message
                                               names the file and what was expected.

Callers can catch the package base class or the builtin one (``except ValueError``).
"""

from __future__ import annotations

__all__ = [
    "DataFileError",
    "ModelConfigError",
    "ModelError",
    "ModelInputError",
    "StateMismatchError",
    "UnknownModelError",
]


class ModelError(Exception):
    """Base class of every error raised by the `models` package."""


class UnknownModelError(ModelError, KeyError):
    """A model name or kind is not in the registry.

    ``str()`` gives the plain message (``KeyError`` would otherwise quote it).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ModelConfigError(ModelError, ValueError):
    """A model option or configuration value is invalid."""


class ModelInputError(ModelError, ValueError):
    """An argument does not fit the model (state subset, input tensor shape)."""


class StateMismatchError(ModelError, ValueError):
    """Arrays do not match a module's state (names, shapes, dtypes or finiteness).

    Raised before anything is copied: the module is unchanged when this is raised.
    """


class DataFileError(ModelError, ValueError):
    """A dataset file cannot be read: missing, truncated, malformed or not allowed."""
