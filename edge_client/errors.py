"""Errors raised by the `edge_client` package.

Every error the package raises derives from :class:`EdgeClientError`; foreign
exceptions (onnxruntime's, numpy's, pydantic's, the transport's) are converted where
they occur::

    EdgeClientError
    ├── InferenceError (also ValueError)   the ONNX model cannot be loaded or run, or
    │                                       an input does not match the model's input
    │                                       (rank, shape, dtype, non-finite values).
    ├── DataError (also ValueError)        a device data file cannot be read, or its
    │                                       arrays have the wrong keys, dtypes, shapes
    │                                       or label range (the message names the file
    │                                       and the key).
    ├── TaskError (also ValueError)        a round task cannot be run as given: unknown
    │                                       strategy, unknown or invalid hyperparameter,
    │                                       missing or mismatched model tensors, an
    │                                       upload mode this client does not support.
    ├── ConfigError (also ValueError)      a client setting is invalid (broker URL,
    │                                       TLS files, ids, limits).
    ├── OnnxTemplateError (also ValueError) an ONNX template cannot be read (malformed,
    │                                       truncated or oversized protobuf, not a
    │                                       template, unsupported content) or rendered
    │                                       (a weight missing, of the wrong shape or
    │                                       non-finite; the message names the tensor).
    └── ConnectError                        the broker could not be reached (or refused
                                            the session) within the configured time.

Callers can catch the package base class or the builtin one (``except ValueError``).
The CLI (``python -m edge_client``) maps :class:`DataError`, :class:`InferenceError`
and :class:`ConfigError` to exit code 2 and :class:`ConnectError` to exit code 1.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ConnectError",
    "DataError",
    "EdgeClientError",
    "InferenceError",
    "OnnxTemplateError",
    "TaskError",
]


class EdgeClientError(Exception):
    """Base class of every error raised by the `edge_client` package."""


class InferenceError(EdgeClientError, ValueError):
    """An ONNX model could not be loaded or run, or an input does not fit the model.

    Raised before the model runs when the input is rejected; no partial output is
    returned.
    """


class DataError(EdgeClientError, ValueError):
    """A device's data file is missing, unreadable or breaks the data contract.

    The message names the file and the offending key; nothing is returned.
    """


class TaskError(EdgeClientError, ValueError):
    """A round task cannot be run: bad strategy, hyperparameters, tensors or upload spec.

    Raised before any training; a model passed in is left unchanged.
    """


class ConfigError(EdgeClientError, ValueError):
    """A client setting is invalid (broker URL, TLS settings, ids, limits)."""


class OnnxTemplateError(EdgeClientError, ValueError):
    """An ONNX template is unreadable or unsupported, or the weights do not fit it.

    Raised by :mod:`edge_client.serve.template` before any output is produced: a render
    either returns the whole new model or raises. The message names the offending
    tensor where there is one.
    """


class ConnectError(EdgeClientError):
    """The broker could not be reached, or refused the session, within the allowed time."""
