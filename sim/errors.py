"""Errors raised by the `sim` package.

Every error the package raises on bad input derives from :class:`SimError`; foreign
exceptions met while reading files (gzip, zipfile, pickle, OS errors) are converted
where they occur::

    SimError
    ├── DatasetError (also ValueError)    a dataset cannot be loaded or written: a file
    │                                     is missing, truncated or malformed, an
    │                                     unknown dataset name or option was given, or
    │                                     arrays break the ArrayDataset contract. The
    │                                     message names the file and what was expected.
    ├── PartitionError (also ValueError)  a dataset cannot be split as asked (too few
    │                                     samples for the devices, no Dirichlet draw
    │                                     meets the minimum device size, bad alpha).
    ├── MetricsError (also ValueError)    a metric cannot be computed from its inputs
    │                                     (an empty test set, mismatched lengths,
    │                                     accuracies outside [0, 1], no device left).
    └── ReportError                       a run report cannot be written: an optional
                                          dependency (matplotlib) is missing, the data
                                          is not JSON-serialisable, or an OS error
                                          occurred while writing (the message names
                                          the file).

Callers can catch the package base class or the builtin one (``except ValueError``).
"""

from __future__ import annotations

__all__ = ["DatasetError", "MetricsError", "PartitionError", "ReportError", "SimError"]


class SimError(Exception):
    """Base class of every error raised by the `sim` package."""


class DatasetError(SimError, ValueError):
    """A dataset could not be loaded, validated or written.

    Raised for missing, truncated or corrupt files (the message says which file and
    what was expected), unknown dataset names or options, and arrays that break the
    :class:`sim.datasets.ArrayDataset` contract.
    """


class PartitionError(SimError, ValueError):
    """A dataset cannot be partitioned across devices with the requested parameters."""


class MetricsError(SimError, ValueError):
    """A metric cannot be computed: empty or mismatched inputs, values out of range."""


class ReportError(SimError):
    """A run report (JSON, CSV or plots) cannot be written.

    Raised when matplotlib is missing for plots (the message says how to install it),
    when the report holds values JSON cannot represent, and for OS errors while
    writing (the message names the file; the OS error is the ``__cause__``).
    """
