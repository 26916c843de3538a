"""Errors raised by the `edge_client` package.

Every error the package raises derives from :class:`EdgeClientError`; foreign
exceptions (onnxruntime's, numpy's) are converted where they occur::

    EdgeClientError
    └── InferenceError (also ValueError)   the ONNX model cannot be loaded or run, or
                                            an input does not match the model's input
                                            (rank, shape, dtype, non-finite values).

Callers can catch the package base class or the builtin one (``except ValueError``).
The CLI (``python -m edge_client``) maps every :class:`EdgeClientError` to exit code 2.
"""

from __future__ import annotations

__all__ = ["EdgeClientError", "InferenceError"]


class EdgeClientError(Exception):
    """Base class of every error raised by the `edge_client` package."""


class InferenceError(EdgeClientError, ValueError):
    """An ONNX model could not be loaded or run, or an input does not fit the model.

    Raised before the model runs when the input is rejected; no partial output is
    returned.
    """
