"""Past one process: the emulated fleet sharded across torch.distributed ranks.

Launched with ``torchrun`` (``torchrun --nproc-per-node 2 -m sim --devices 10000``; on
several hosts with ``--nnodes``, ``--rdzv-endpoint`` and ``--broker mqtt://HOST:PORT``
that every host reaches), every rank emulates its slice of the fleet
(:meth:`Shard.devices`: contiguous blocks) against the same broker; rank 0 also runs the
coordinator, the evaluation and the report, and starts the embedded broker when no
``--broker`` is given (its URL reaches the other ranks by :func:`broadcast`). Each rank
trains on its own accelerator (``cuda:LOCAL_RANK``) when there is one.

The ranks talk over a gloo process group (CPU, small Python objects only): the broker
URL at the start, every rank's byte counters when a round closes (so each round's bytes
are the whole fleet's) and every rank's peak memory at the end. A follower answers those
requests on a thread of its own (:class:`RoundSync`) while its devices run.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = ["RoundSync", "Shard", "broadcast", "current_shard", "training_device"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class Shard:
    """This process's place in a sharded run."""

    rank: int
    world: int
    local_rank: int = 0

    @property
    def leader(self) -> bool:
        """Whether this rank runs the coordinator and writes the report."""
        return self.rank == 0

    def devices(self, count: int) -> range:
        """The indices of the devices this rank emulates, out of ``count``: a
        contiguous block, the blocks' sizes differing by at most one."""
        return range(count * self.rank // self.world, count * (self.rank + 1) // self.world)


def current_shard() -> Shard | None:
    """The shard torchrun's environment describes (joining its gloo process group), or
    None when this process runs alone (``WORLD_SIZE`` unset or 1)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return Shard(dist.get_rank(), dist.get_world_size(), local)


def training_device(name: str, shard: Shard | None) -> str:
    """The device name to train on: ``cuda`` becomes this rank's ``cuda:LOCAL_RANK``."""
    if shard is None or name == "cpu":
        return name
    if name == "auto" and not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{shard.local_rank % max(1, torch.cuda.device_count())}"


def broadcast(value: _T | None) -> _T:
    """Rank 0's ``value`` on every rank."""
    box: list[Any] = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]  # type: ignore[no-any-return]


class RoundSync:
    """Rank 0 collects every rank's answer to a question, while the ranks run.

    On rank 0, :meth:`ask` sends a question to the others and returns every rank's
    answer (its own first); on the others, a thread answers each question with
    ``answer(question)`` until rank 0 calls :meth:`close`. All of a rank's collectives go
    through one instance (gloo calls of one rank must not interleave).

    Args:
        shard: this rank.
        answer: what this rank says to a question (e.g. its byte counters).
    """

    def __init__(self, shard: Shard, answer: Callable[[str], Any]) -> None:
        self.shard = shard
        self._answer = answer
        self._lock = threading.Lock()
        self._closed = False
        self.released = threading.Event()
        """Set on the other ranks once rank 0 released them."""
        self._thread: threading.Thread | None = None
        if not shard.leader:
            self._thread = threading.Thread(target=self._serve, name="sim-shard", daemon=True)
            self._thread.start()

    def ask(self, question: str) -> list[Any]:
        """Every rank's answer to ``question``, by rank (rank 0 only)."""
        if not self.shard.leader:
            raise RuntimeError("only rank 0 asks")
        with self._lock:
            if self._closed:
                raise RuntimeError("the ranks were released")
            broadcast(question)
            answers: list[Any] = [None] * self.shard.world
            dist.all_gather_object(answers, self._answer(question))
            return answers

    def close(self) -> None:
        """Rank 0: release the other ranks' threads. Others: wait until released. Then
        every rank leaves the process group together (a rank that exits with gloo's
        threads still up may abort at exit)."""
        if self.shard.leader:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
                broadcast(None)
        elif self._thread is not None:
            self._thread.join()
            self._thread = None
        else:
            return
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def _serve(self) -> None:
        while True:
            question: str | None = broadcast(None)
            if question is None:
                self.released.set()
                return
            answers: list[Any] = [None] * self.shard.world
            try:
                mine = self._answer(question)
            except Exception as exc:  # rank 0 must still get an answer
                log.exception("rank %d could not answer %r", self.shard.rank, question)
                mine = {"error": repr(exc)}
            dist.all_gather_object(answers, mine)
