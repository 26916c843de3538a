"""What a device keeps for quantized transfers, and how it decodes and encodes models.

* **The model it holds.** The first set of every task (``global``, ``student`` or
  ``head``) is the device's model. After decoding it, the device keeps it (in memory and,
  with a state folder, in ``base.npz``) and announces its content fingerprint in its
  hello (``held_base``): the coordinator may then send the next model as a delta against
  it. A delta against a base the device does not hold raises
  :class:`~protocol.deltas.UnknownBaseError`; the client then says hello again, and the
  coordinator sends the model in full.
* **Error feedback.** A lossy upload is ``trained - received`` plus the residual the
  previous upload's quantization lost; the new residual is kept (``residual.npz``), so
  the sum of what the coordinator receives tracks the sum of the true deltas within one
  quantization step, however many rounds pass. The new residual is staged
  (``residual.staged.npz``, with the content fingerprint of the upload it belongs to)
  until the update is sent, then takes the old one's place (a rename: ``residual.npz``
  keeps that ``__upload__`` entry, which reading it drops). A device killed
  in between restarts with that update unacknowledged and sends it again
  (:meth:`TransferState.recover`): the staged residual is kept when it belongs to that
  very update, dropped otherwise, so the next upload is the one an uninterrupted device
  would send.

Numpy only; no torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edge_client.train.client_state import fsync_dir, read_model, write_model
from protocol.arrays import content_fingerprint
from protocol.deltas import decode_sets, encode_delta, shared_fingerprint
from protocol.errors import EncodeError
from protocol.messages import Message, Update, UploadSpec
from protocol.tensorset import TensorSet, encode_tensors

__all__ = ["BASE_FILE", "RESIDUAL_FILE", "STAGED_FILE", "TransferState"]

logger = logging.getLogger(__name__)

Array = npt.NDArray[Any]
Arrays = dict[str, Array]

BASE_FILE = "base.npz"
"""The model the device holds from its last task (the base of downlink deltas)."""
RESIDUAL_FILE = "residual.npz"
"""The uplink quantization residual (error feedback)."""
STAGED_FILE = "residual.staged.npz"
"""The residual of the last lossy upload encoded, until that upload is sent."""
_UPLOAD_KEY = "__upload__"
"""The staged file's entry naming its upload (the content fingerprint of its values)."""


class TransferState:
    """A device's held model and uplink residual, persisted in ``state_dir`` if given."""

    def __init__(self, state_dir: Path | None = None, *, fsync: bool = True) -> None:
        self._dir = state_dir
        self._fsync = fsync
        self._held: Arrays | None = None
        self._held_fingerprint: str | None = None
        self._residual: Arrays | None = None
        self._staged: Arrays | None = None  # the residual of an update not yet sent
        if state_dir is not None:
            self._held = self._read(BASE_FILE)
            self._residual = self._read(RESIDUAL_FILE)
            if self._held is not None:
                self._held_fingerprint = content_fingerprint(self._held)

    @property
    def held_fingerprint(self) -> str | None:
        """Content fingerprint of the model held (None: none)."""
        return self._held_fingerprint

    def decode(
        self, sets: Mapping[str, TensorSet], names: Sequence[str], *, hold: bool = True
    ) -> dict[str, Arrays]:
        """Decode the task's sets ``names`` (deltas resolved); with ``hold``, keep the first
        as the held model (tasks with lossy transfers; fp32 ones need no base).

        Raises:
            UnknownBaseError: a delta against a model this device does not hold.
            DecodeError: a set is missing or does not fit its base.
        """
        out = decode_sets(
            sets, names, self._held, shared=True, held_fingerprint=self._held_fingerprint
        )
        if names and hold:
            model = out[names[0]]
            # the shared decoding is read-only: held as it is, one copy for every device
            # of a fleet that received the message
            self._held = dict(model)
            known = shared_fingerprint(sets[names[0]])
            self._held_fingerprint = known or content_fingerprint(self._held)
            self._write(BASE_FILE, self._held)
        return out

    def encode_upload(
        self,
        weights: Mapping[str, Array],
        spec: UploadSpec,
        received: Mapping[str, Mapping[str, Array]],
        *,
        commit: bool = True,
    ) -> TensorSet:
        """The ``weights`` set of an update, as ``spec`` asks.

        A delta upload is taken against the received set ``spec.base`` (as decoded) and
        carries the residual of the previous delta upload (when it has the same tensors);
        the new residual replaces it, at once or, with ``commit=False``, when
        :meth:`commit_upload` says the update was sent (an update never sent leaves the
        error feedback as it was).

        Raises:
            EncodeError: the base set was not received, does not fit, or a value cannot
                be encoded.
        """
        if spec.mode != "delta":
            return encode_tensors(weights, spec.precision)
        assert spec.base is not None  # UploadSpec checks it
        base = received.get(spec.base)
        if base is None:
            raise EncodeError(f"the upload's base set {spec.base!r} was not received")
        residual = self._residual if _fits(self._residual, weights) else None
        encoded = encode_delta(
            weights, base, content_fingerprint(base), spec.precision, residual=residual
        )
        self._staged = encoded.residual
        if commit:
            self.commit_upload()
        elif self._dir is not None:
            key = np.array(_upload_key(encoded.tensors))
            self._write(STAGED_FILE, {**encoded.residual, _UPLOAD_KEY: key})
        return encoded.tensors

    def commit_upload(self) -> None:
        """Keep (and persist) the residual of the last delta encoded: it was sent."""
        if self._staged is None:
            return
        self._residual, self._staged = self._staged, None
        if self._dir is not None and (self._dir / STAGED_FILE).exists():
            self._promote()
        else:
            self._write(RESIDUAL_FILE, self._residual)

    def recover(self, unacked: Message | None) -> None:
        """At a restart: keep the staged residual if it belongs to ``unacked``, the update
        the device will send again (it was encoded, perhaps sent, never acknowledged);
        drop it otherwise (its upload was never persisted, so it is never sent)."""
        if self._dir is None or not (self._dir / STAGED_FILE).exists():
            return
        staged = self._read(STAGED_FILE)
        key = None if staged is None else staged.pop(_UPLOAD_KEY, None)
        body = None if unacked is None else unacked.body
        weights = body.sets.get("weights") if isinstance(body, Update) else None
        if (
            staged is not None
            and key is not None
            and weights is not None
            and str(key) == _upload_key(weights)
        ):
            self._residual = staged
            self._promote()
            logger.info("kept the residual of the unacknowledged update, sent again")
            return
        try:
            (self._dir / STAGED_FILE).unlink()
        except OSError as exc:
            logger.warning("could not remove %s: %s", self._dir / STAGED_FILE, exc)

    def _promote(self) -> None:
        """The staged file becomes the residual file (atomic rename, then the folder's
        fsync)."""
        assert self._dir is not None
        try:
            os.replace(self._dir / STAGED_FILE, self._dir / RESIDUAL_FILE)
            if self._fsync:
                fsync_dir(self._dir)
        except OSError as exc:
            logger.warning("could not keep the residual in %s: %s", self._dir, exc)

    # -- persistence -------------------------------------------------------------------

    def _read(self, name: str) -> Arrays | None:
        assert self._dir is not None
        path = self._dir / name
        if not path.exists():
            return None
        try:
            arrays = read_model(path)
        except (OSError, ValueError) as exc:
            logger.warning("ignored the unreadable %s: %s", path, exc)
            return None
        if name == RESIDUAL_FILE:
            arrays.pop(_UPLOAD_KEY, None)  # a promoted staged file names its upload
        return arrays

    def _write(self, name: str, arrays: Mapping[str, Array]) -> None:
        if self._dir is None:
            return
        try:
            write_model(self._dir / name, arrays, fsync=self._fsync)
        except OSError as exc:
            logger.warning("could not save %s: %s", self._dir / name, exc)


def _upload_key(tensors: TensorSet) -> str:
    """What names an upload in the staged file: the content fingerprint of its values."""
    return content_fingerprint(tensors.to_arrays())


def _fits(residual: Mapping[str, Array] | None, weights: Mapping[str, Array]) -> bool:
    if residual is None or residual.keys() != weights.keys():
        return False
    return all(np.shape(residual[k]) == np.shape(weights[k]) for k in weights)
