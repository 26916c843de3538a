"""The hostile client of benchmarks/abuse.py: it reads everything on a fleet's device
topics and builds bursts of bad input, one category at a time, for every topic the
coordinator reads (honest ids, ids without a key, the rogue id, ids outside the layout),
and for the fleet-wide topics every device reads (the coordinator's status). It also
holds the honest devices' keys, as an attacker who compromised them would
(``int_tensors``).
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zstandard

from protocol.auth import Keyring, new_key, seal
from protocol.chunking import CHUNK_HEADER_SIZE, Reassembler, split_frame
from protocol.codec import (
    FRAME_CHUNK,
    FRAME_MAGIC,
    FRAME_MESSAGE,
    MESSAGE_PREFIX_SIZE,
    Codec,
    signed_twin,
)
from protocol.errors import DecodeError
from protocol.limits import DecodeLimits, ReassemblyLimits
from protocol.messages import PROTOCOL_VERSION, CoordinatorStatus, Message, Update
from protocol.signing import SigningKey
from protocol.transport.base import Inbound
from protocol.transport.config import MqttConfig
from protocol.transport.mqtt import MqttTransport

__all__ = ["FENCE", "FLEET", "ROGUE", "Hostile", "envelope"]

FLEET = "abuse"
ROGUE = "rogue-0"
"""An id with a key in the keyring that never says hello (an insider's stolen key, or a
device provisioned but never started): its frames pass authentication."""
FENCE = 1_000_000
"""Fence k is an update of the rogue id for round FENCE + k."""
LEAVES = ("hello", "status", "update")
GARBAGE_IDS = ("bad id!", "x" * 80, "..", "-lead", "caf\u00e9", "a/b", "")


# -- frames --------------------------------------------------------------------------------

_ZSTD = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=True)


def _frame(payload: bytes, key: bytes | None, topic: str) -> bytes:
    """A message frame around a zstd frame of ``payload``, sealed with ``key``."""
    frame = FRAME_MAGIC + bytes((PROTOCOL_VERSION, FRAME_MESSAGE)) + bytes(32)
    frame += _ZSTD.compress(payload)
    return seal(key, topic, frame) if key is not None else frame


def envelope(frame: bytes) -> dict[str, Any] | None:
    """The msgpack envelope of a captured frame (no key needed to read it)."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(frame[MESSAGE_PREFIX_SIZE:])
        env = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:
        return None
    return env if isinstance(env, dict) else None


def _fresh(env: dict[str, Any], sender: str, rng: random.Random) -> dict[str, Any]:
    return {**env, "sender": sender, "id": rng.randbytes(16), "ts": int(time.time() * 1000)}


def _huge_shape(env: dict[str, Any]) -> bool:
    """Set the first tensor's shape in ``env`` to 2**31 x 2**31; False if none found."""

    def visit(node: Any) -> bool:
        if (
            isinstance(node, list)
            and len(node) == 7
            and isinstance(node[0], str)
            and isinstance(node[1], list)
        ):
            node[1] = [2**31, 2**31]
            return True
        children = node.values() if isinstance(node, dict) else node
        if isinstance(node, (dict, list)):
            return any(visit(child) for child in children)
        return False

    return visit(env.get("body"))


_BOMBS: list[bytes] = []


def _bombs() -> list[bytes]:
    """Two zstd frames of max_message_bytes + 1 zero bytes (a few kB each): one declaring
    its content size, one without (as a streaming compressor writes it)."""
    if not _BOMBS:
        zeros = bytes(DecodeLimits().max_message_bytes + 1)
        for declared in (True, False):
            z = zstandard.ZstdCompressor(level=3, write_checksum=True, write_content_size=declared)
            _BOMBS.append(z.compress(zeros) if declared else _streamed(z, zeros))
    return _BOMBS


def _streamed(z: zstandard.ZstdCompressor, data: bytes) -> bytes:
    chunker = z.compressobj()
    return chunker.compress(data) + chunker.flush()


# -- the hostile client --------------------------------------------------------------------


_OTHER_VERSIONS = tuple(v for v in (0, 1, 2, 3, 4, 5, 6, 255) if v != PROTOCOL_VERSION)
"""Version bytes this build refuses: every earlier one, the next, and 255."""


class Hostile:
    """Reads everything on the devices' topics and publishes bad input in bursts."""

    def __init__(
        self,
        url: str,
        honest: list[str],
        rogue_key: bytes,
        seed: int,
        client_id: str,
        stolen: Keyring | None = None,
    ) -> None:
        self.rng = random.Random(seed)
        self.honest = honest
        self.rogue_key = rogue_key
        self.stolen = stolen or Keyring()
        """Honest devices' keys the attacker compromised."""
        self.impostor = SigningKey(self.rng.randbytes(32))
        """A signing key of the attacker's own (not the coordinator's)."""
        self.tasks: dict[str, tuple[int, str]] = {}
        """Device -> (round, message id hex) of the newest task it was sent."""
        self.task_frames: list[tuple[str, bytes]] = []
        """The first 64 task frames seen (topic, frame): genuine, to replay in a later run."""
        self.earlier_tasks: list[tuple[str, bytes]] = []
        """Task frames of an earlier run (another listener's ``task_frames``)."""
        self._lock = threading.Lock()
        self.captured: dict[str, list[bytes]] = {}  # topic -> message frames seen
        self.chunks: list[tuple[str, bytes]] = []  # chunk frames seen
        self.offline: list[tuple[str, bytes]] = []  # offline statuses seen past the 16
        self._update_ids: set[str] = set()  # message ids (hex) of every honest update seen
        self._reassembler = Reassembler(  # the hostile client's own: roomy and patient
            ReassemblyLimits(
                max_source_transfers=1024, max_pending_transfers=4096, timeout_s=86400.0
            )
        )
        self.nacks: list[str] = []  # topics of nacks to honest devices
        self._sent: set[bytes] = set()  # digests of what it published: not captured back
        self._transport = MqttTransport(MqttConfig.from_url(url, client_id=client_id))

    def start(self) -> None:
        self._transport.connect()
        self._transport.subscribe(f"fl/{FLEET}/devices/+/+", self._capture)
        self._transport.subscribe(f"fl/{FLEET}/to/+/ack", self._ack)
        self._transport.subscribe(f"fl/{FLEET}/to/+/task", self._task)

    def stop(self) -> None:
        self._transport.disconnect()

    def _capture(self, inbound: Inbound) -> None:
        device = inbound.topic.split("/")[3]
        payload = bytes(inbound.payload)
        if device not in self.honest or payload[:2] != FRAME_MAGIC:
            return
        with self._lock:
            if hashlib.sha256(payload).digest() in self._sent:
                return
            if payload[3:4] == bytes((FRAME_CHUNK,)) and len(self.chunks) < 256:
                self.chunks.append((inbound.topic, payload))
            try:
                frame = self._reassembler.feed(inbound.topic, payload)
            except DecodeError:
                return
            if frame is not None and inbound.topic.endswith("/update"):
                env = envelope(frame)
                if env is not None and isinstance(env.get("id"), bytes):
                    self._update_ids.add(env["id"].hex())
            frames = self.captured.setdefault(inbound.topic, []) if frame is not None else []
            if frame is not None and len(frames) < 16:
                frames.append(frame)
            elif frame is not None and inbound.topic.endswith("/status") and len(self.offline) < 64:
                env = envelope(frame)  # a device's goodbye or will comes last: kept apart
                if env is not None and env.get("body", {}).get("state") == "offline":
                    self.offline.append((inbound.topic, frame))

    def _ack(self, inbound: Inbound) -> None:
        env = envelope(inbound.payload)
        body = env.get("body") if env is not None else None
        honest = inbound.topic.split("/")[3] in self.honest
        if honest and isinstance(body, dict) and body.get("accepted") is False:
            with self._lock:
                self.nacks.append(inbound.topic)

    def _task(self, inbound: Inbound) -> None:
        env = envelope(inbound.payload)
        if env is None or not isinstance(env.get("id"), bytes):
            return
        with self._lock:
            self.tasks[inbound.topic.split("/")[3]] = (int(env["round"]), env["id"].hex())
            if len(self.task_frames) < 64:
                self.task_frames.append((inbound.topic, bytes(inbound.payload)))

    def honest_update(self, message_id: str) -> bool:
        """Whether ``message_id`` (hex) is one of an honest device's own updates: the
        coordinator's "a duplicate" line about it answers that device's retry, not an
        attack (the hostile client's updates all carry ids of its own)."""
        with self._lock:
            return message_id in self._update_ids

    def ready(self) -> bool:
        """Whether a hello and an update of some honest device were seen."""
        with self._lock:
            leaves = {t.rsplit("/", 1)[1] for t in self.captured}
        return {"hello", "update"} <= leaves

    def frames(self, leaf: str | None = None) -> list[tuple[str, bytes]]:
        with self._lock:
            kept = [(t, f) for t, fs in self.captured.items() for f in fs] + self.offline
        return [(t, f) for t, f in kept if leaf is None or t.endswith("/" + leaf)]

    # topics

    def topic(self, device: str, leaf: str) -> str:
        return f"fl/{FLEET}/devices/{device}/{leaf}"

    def any_topic(self) -> str:
        """A topic of an honest, unregistered, rogue or garbage id, any leaf."""
        rng = self.rng
        kind = rng.choice(("honest", "honest", "unregistered", "rogue", "garbage"))
        leaf = rng.choice(LEAVES)
        if kind == "honest":
            return self.topic(rng.choice(self.honest), leaf)
        if kind == "unregistered":
            return self.topic(f"intruder-{rng.randrange(100)}", leaf)
        if kind == "rogue":
            return self.topic(ROGUE, leaf)
        garbage = rng.choice(GARBAGE_IDS)
        return rng.choice((self.topic(garbage, leaf), f"fl/{FLEET}/devices/{garbage}"))

    def publish(self, topic: str, payload: bytes) -> None:
        with self._lock:
            self._sent.add(hashlib.sha256(payload).digest())
        self._transport.publish(topic, payload, qos=1, timeout=60.0)

    # categories: each returns the (topic, payload) pairs of one burst

    def burst(self, category: str, n: int, old: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        if category in ("replay", "stale_offline"):
            return self._replay(n, old) if category == "replay" else self._stale_offline(n, old)
        make: Callable[[int], list[tuple[str, bytes]]] = getattr(self, f"_{category}")
        return make(n)

    def _random_bytes(self, n: int) -> list[tuple[str, bytes]]:
        rng = self.rng
        out = []
        for i in range(n):
            head = rng.choice((b"", FRAME_MAGIC + bytes((PROTOCOL_VERSION, FRAME_MESSAGE))))
            out.append((self.any_topic(), head + rng.randbytes(rng.randrange(i % 2, 4096))))
        return out

    def _damaged(self, n: int, damage: Callable[[bytes], bytes]) -> list[tuple[str, bytes]]:
        frames = self.frames()
        picks = [self.rng.choice(frames) for _ in range(n)]
        return [(topic, damage(frame)) for topic, frame in picks]

    def _truncated(self, n: int) -> list[tuple[str, bytes]]:
        return self._damaged(n, lambda f: f[: self.rng.randrange(0, len(f))])

    def _bit_flipped(self, n: int) -> list[tuple[str, bytes]]:
        def flip(frame: bytes) -> bytes:
            data = bytearray(frame)
            for _ in range(self.rng.randint(1, 8)):
                bit = self.rng.randrange(len(data) * 8)
                data[bit // 8] ^= 1 << (bit % 8)
            return bytes(data)

        return self._damaged(n, flip)

    def _sealed_targets(self, n: int) -> list[tuple[str, bytes | None]]:
        """Topics with the key the hostile client uses there: the rogue's own key
        (passes authentication), a wrong key on honest ids, none on unregistered ids."""
        out: list[tuple[str, bytes | None]] = []
        for i in range(n):
            leaf = self.rng.choice(LEAVES)
            if i % 3 == 0:
                out.append((self.topic(self.rng.choice(self.honest), leaf), new_key()))
            elif i % 3 == 1:
                out.append((self.topic(ROGUE, leaf), self.rogue_key))
            else:
                out.append((self.topic(f"intruder-{self.rng.randrange(100)}", leaf), None))
        return out

    def _zstd_bomb(self, n: int) -> list[tuple[str, bytes]]:
        bomb, streamed = _bombs()
        out = []
        for i, (topic, key) in enumerate(self._sealed_targets(n)):
            body = bomb if i % 2 == 0 else streamed
            frame = FRAME_MAGIC + bytes((PROTOCOL_VERSION, FRAME_MESSAGE)) + bytes(32) + body
            out.append((topic, seal(key, topic, frame) if key is not None else frame))
        return out

    def _msgpack_bomb(self, n: int) -> list[tuple[str, bytes]]:
        bombs = [
            b"\xdd\xff\xff\xff\xff",  # array32 of 4 G elements, none present
            b"\xdf\xff\xff\xff\xff",  # map32 of 4 G pairs
            b"\x91" * 200_000 + b"\xc0",  # arrays nested 200 000 deep
            b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
            b"\x81\xa4body" + b"\x81\xa1x" * 50_000 + b"\xc0",  # maps nested 50 000 deep
        ]
        return [
            (topic, _frame(bombs[i % len(bombs)], key, topic))
            for i, (topic, key) in enumerate(self._sealed_targets(n))
        ]

    def _huge_shape(self, n: int) -> list[tuple[str, bytes]]:
        updates = [env for _, f in self.frames("update") if (env := envelope(f)) is not None]
        out = []
        for topic, key in self._sealed_targets(n):
            env = _fresh(self.rng.choice(updates), topic.split("/")[3], self.rng)
            env["kind"] = "update"
            _huge_shape(env)
            where = topic.rsplit("/", 1)[0] + "/update"
            out.append((where, _frame(msgpack.packb(env, use_bin_type=True), key, where)))
        return out

    def _wrong_version(self, n: int) -> list[tuple[str, bytes]]:
        frames = self.frames()
        out = []
        for i in range(n):
            topic, frame = self.rng.choice(frames)
            if i % 3 == 0:
                version = self.rng.choice(_OTHER_VERSIONS)
                head = FRAME_MAGIC + bytes((version, frame[3]))
            elif i % 3 == 1:
                head = self.rng.choice((b"LF", b"\x00\x00", b"PK")) + frame[2:4]
            else:
                head = FRAME_MAGIC + bytes((PROTOCOL_VERSION, self.rng.choice((0, 3, 0xFF))))
            out.append((self.rng.choice((topic, self.any_topic())), head + frame[4:]))
        return out

    def _oversize(self, n: int) -> list[tuple[str, bytes]]:
        out = []
        for topic, key in self._sealed_targets(n):
            frame = _frame(b"\xc0", key, topic)
            first = split_frame(frame + bytes(200), 128)[0]  # a valid chunk header...
            count, total = self.rng.choice(((2, 1 << 40), (1 << 20, 1 << 21), (2, 1 << 30)))
            head = bytearray(first[:CHUNK_HEADER_SIZE])
            head[56:60] = count.to_bytes(4, "big")  # ...announcing too many chunks or bytes
            head[60:68] = total.to_bytes(8, "big")
            out.append((topic, bytes(head) + first[CHUNK_HEADER_SIZE:]))
        return out

    def fence(self, k: int) -> tuple[str, bytes]:
        """An update of the rogue id for round FENCE + k: refused with a line naming it."""
        topic = self.topic(ROGUE, "update")
        body = Update(num_samples=1, sets={})
        message = Message(fleet=FLEET, sender=ROGUE, round=FENCE + k, body=body)
        return topic, seal(self.rogue_key, topic, Codec().encode(message))

    def oversize_frame(self) -> tuple[str, bytes]:
        """One frame one byte over the decoder's limit, sealed with the rogue's key."""
        topic = self.topic(ROGUE, "update")
        limit = DecodeLimits().max_frame_bytes
        frame = FRAME_MAGIC + bytes((PROTOCOL_VERSION, FRAME_MESSAGE)) + bytes(32)
        frame += bytes(limit + 1 - len(frame))
        return topic, seal(self.rogue_key, topic, frame)

    def _forged_sender(self, n: int) -> list[tuple[str, bytes]]:
        frames = self.frames()
        out = []
        for i in range(n):
            topic, frame = self.rng.choice(frames)
            env = envelope(frame)
            if env is None:
                continue
            if i % 2 == 0:  # the honest device's topic and sender, a wrong key
                env = _fresh(env, env["sender"], self.rng)
                out.append((topic, _frame(msgpack.packb(env, use_bin_type=True), new_key(), topic)))
            else:  # the rogue's topic and key, an honest sender
                leaf = topic.rsplit("/", 1)[1]
                mine = self.topic(ROGUE, leaf)
                env = _fresh(env, env["sender"], self.rng)
                payload = msgpack.packb(env, use_bin_type=True)
                out.append((mine, _frame(payload, self.rogue_key, mine)))
        return out

    def _replay(self, n: int, old: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        with self._lock:
            chunks = list(self.chunks)
        pool = self.frames() + chunks + old
        return [self.rng.choice(pool) for _ in range(n)] if pool else []

    def _unregistered(self, n: int) -> list[tuple[str, bytes]]:
        frames = self.frames()
        out = []
        for i in range(n):
            topic, frame = self.rng.choice(frames)
            env = envelope(frame)
            if env is None:
                continue
            leaf = topic.rsplit("/", 1)[1]
            who = f"intruder-{self.rng.randrange(100)}"
            mine = self.topic(who, leaf)
            env = _fresh(env, who, self.rng)
            key = new_key() if i % 2 else None
            out.append((mine, _frame(msgpack.packb(env, use_bin_type=True), key, mine)))
        return out

    def _chunk_flood(self, n: int) -> list[tuple[str, bytes]]:
        out = []
        for i in range(n):
            if i % 4 == 0:
                topic = self.topic(self.rng.choice(self.honest), "update")
            elif i % 4 == 1:
                topic = self.topic(ROGUE, "update")
            elif i % 4 == 2:
                topic = self.topic(f"intruder-{self.rng.randrange(100)}", "update")
            else:
                topic = self.topic(self.rng.choice(GARBAGE_IDS[:5]), "update")
            frame = _frame(self.rng.randbytes(4096), None, topic)
            out.append((topic, split_frame(frame, 1024)[0]))
        return out

    def _forged_fleet(self, n: int) -> list[tuple[str, bytes]]:
        """The coordinator's status, forged: ``starting`` (every device would say hello
        again and, before version 6, lose its delta base) and ``finished`` (every device
        would stop), unsigned or signed with the attacker's own key."""
        topic = f"fl/{FLEET}/coordinator/status"
        out = []
        for i in range(n):
            state = ("starting", "finished")[i % 2]
            body = CoordinatorStatus(state=state)
            frame = Codec().encode(Message(fleet=FLEET, sender="coordinator", body=body))
            if (i // 2) % 2:
                frame = self.impostor.sign(topic, signed_twin(frame))
            out.append((topic, frame))
        return out

    def _int_tensors(self, n: int) -> list[tuple[str, bytes]]:
        """Updates of the current round under a compromised honest key whose tensors
        are int64 with the model's names and shapes (before version 6 they passed the
        weight check and the norm screen, and destroyed the model)."""
        with self._lock:
            tasks = dict(self.tasks)
        updates = [(t, f) for t, f in self.frames("update") if t.split("/")[3] in tasks]
        out = []
        for _ in range(n if updates else 0):
            topic, frame = self.rng.choice(updates)
            device = topic.split("/")[3]
            env = envelope(frame)
            if env is None or device not in self.stolen:
                continue
            round_, task_id = tasks[device]
            weights = env["body"]["sets"]["weights"]
            weights["mode"], weights["base"] = "full", None
            weights["tensors"] = [
                [t[0], t[1], "int64", "raw", 0, _int64s(t[1], 10**6), None]
                for t in weights["tensors"]
            ]
            env = _fresh(env, device, self.rng)
            env["round"], env["body"]["task_message"] = round_, task_id
            payload = msgpack.packb(env, use_bin_type=True)
            out.append((topic, _frame(payload, self.stolen[device], topic)))
        return out

    def _stale_task(self, n: int) -> list[tuple[str, bytes]]:
        """Genuine tasks of the devices' earlier run, replayed to them: before version 7
        a task whose deadline had not passed long ago was trained on, and the device then
        skipped its real rounds ("a later round is done")."""
        tasks = self.earlier_tasks
        return [self.rng.choice(tasks) for _ in range(n)] if tasks else []

    def _stale_offline(self, n: int, old: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """Genuine ``offline`` statuses of the devices' earlier run (their last wills or
        goodbyes, captured in the reference run), replayed: before version 6 each took a
        live device out of selection."""
        offline = []
        for topic, frame in old:
            env = envelope(frame) if topic.endswith("/status") else None
            if env is not None and env.get("body", {}).get("state") == "offline":
                offline.append((topic, frame))
        return [self.rng.choice(offline) for _ in range(n)] if offline else []


def _int64s(shape: list[int], value: int) -> bytes:
    count = 1
    for dim in shape:
        count *= dim
    return value.to_bytes(8, "little", signed=True) * count
