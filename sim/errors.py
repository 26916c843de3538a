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
    └── PartitionError (also ValueError)  a dataset cannot be split as asked (too few
                                          samples for the devices, no Dirichlet draw
                                          meets the minimum device size, bad alpha).

The run report and the evaluation live in the coordinator (``coordinator.report``,
``coordinator.evaluation``), as do their errors (``ReportError``, ``MetricsError``: both
``CoordinatorError``); the command line turns them into ``SimError`` where it meets them.

Callers can catch the package base class or the builtin one (``except ValueError``).
"""

from __future__ import annotations

__all__ = ["DatasetError", "PartitionError", "SimError"]


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
