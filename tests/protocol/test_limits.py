"""Each decoder bound, proven: DecodeLimits (codec) and ReassemblyLimits (chunks)."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zstandard

from protocol.chunking import Reassembler, split_frame, transfer_sent_ms
from protocol.codec import Codec
from protocol.errors import DecodeError, QuotaError
from protocol.limits import DecodeLimits, ReassemblyLimits
from protocol.messages import Message, ModelPayload
from protocol.tensors import encode_array
from protocol.tensorset import TensorSet, encode_tensors

HEADER = b"FL\x07\x01" + bytes(32)


def model_frame(arrays: dict[str, np.ndarray], sets: int = 1, precision: str = "fp32") -> bytes:
    payload = {f"s{i}": encode_tensors(arrays, precision) for i in range(sets)}
    message = Message(fleet="lab", sender="coordinator", body=ModelPayload(sets=payload))
    return Codec().encode(message)


def raw_tensor_frame(tensor: list[object]) -> bytes:
    """A model message with one hand-made tensor, bypassing the encoder's checks."""
    env = Codec().envelope(
        Message(fleet="lab", sender="c", body=ModelPayload(sets={"m": TensorSet()}))
    )
    env["body"]["sets"]["m"]["tensors"] = [tensor]  # type: ignore[index]
    return HEADER + zstandard.ZstdCompressor(write_checksum=True).compress(
        msgpack.packb(env, use_bin_type=True)
    )


def decode_with(frame: bytes, **limits: object) -> Message:
    return Codec(limits=DecodeLimits(**limits)).decode(frame)  # type: ignore[arg-type]


# -- DecodeLimits ---------------------------------------------------------------------


def test_max_frame_bytes() -> None:
    frame = model_frame({"w": np.ones(1000, np.float32)})
    decode_with(frame, max_frame_bytes=len(frame))
    with pytest.raises(DecodeError, match="frame is"):
        decode_with(frame, max_frame_bytes=len(frame) - 1)


def test_max_message_bytes_stops_a_zstd_bomb_before_allocating() -> None:
    bomb = HEADER + zstandard.ZstdCompressor(write_checksum=True).compress(b"\0" * (8 << 20))
    assert len(bomb) < 2000
    with pytest.raises(DecodeError, match="would decompress to 8388608 bytes"):
        decode_with(bomb, max_message_bytes=1 << 20)


def test_frames_without_declared_content_size_are_refused() -> None:
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    body = stream.compress(msgpack.packb({"a": 1})) + stream.flush()
    with pytest.raises(DecodeError, match="declare its content size"):
        Codec().decode(HEADER + body)


def test_frames_without_content_checksum_are_refused() -> None:
    # Prepare
    raw = Codec().pack(Message(fleet="lab", sender="c", body=ModelPayload(sets={})))
    with_checksum = HEADER + zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    without = HEADER + zstandard.ZstdCompressor(write_checksum=False).compress(raw)
    # Execute, Assert
    Codec().decode(with_checksum)
    with pytest.raises(DecodeError, match="content checksum"):
        Codec().decode(without)


def test_frames_naming_a_dictionary_or_not_zstd_are_refused() -> None:
    # Prepare: the same content behind a frame header with a dictionary id, and a
    # skippable zstd frame (magic 0x184D2A50) in place of the zstd frame
    samples = [bytes([i % 7]) * 50 + b"xyz" * i for i in range(200)]
    dictionary = zstandard.train_dictionary(1024, samples)
    raw = Codec().pack(Message(fleet="lab", sender="c", body=ModelPayload(sets={})))
    comp = zstandard.ZstdCompressor(dict_data=dictionary, write_checksum=True)
    skippable = bytes.fromhex("502a4d18") + len(raw).to_bytes(4, "little") + raw
    # Execute, Assert
    plain = HEADER + zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    id_zero = plain[:40] + bytes([plain[40] | 1, 0]) + plain[41:]  # Dictionary_ID_flag 1, id 0
    with pytest.raises(DecodeError, match="must not name a dictionary"):
        Codec().decode(HEADER + comp.compress(raw))
    with pytest.raises(DecodeError, match="must not name a dictionary"):
        Codec().decode(id_zero)
    with pytest.raises(DecodeError, match="bad zstd magic"):
        Codec().decode(HEADER + skippable)


def test_truncated_and_trailing_bytes() -> None:
    frame = model_frame({"w": np.arange(100, dtype=np.float32)})
    for cut in (5, 1, len(frame) // 2):
        with pytest.raises(DecodeError):
            Codec().decode(frame[:-cut])
    with pytest.raises(DecodeError, match="unused data"):
        Codec().decode(frame + b"\0")
    packed = Codec().pack(Codec().decode(frame)) + b"\xc0"
    with pytest.raises(DecodeError, match="ExtraData"):
        Codec().decode(HEADER + zstandard.ZstdCompressor(write_checksum=True).compress(packed))


def test_max_tensors() -> None:
    frame = model_frame({f"t{i}": np.ones(2, np.float32) for i in range(10)}, sets=2)
    decode_with(frame, max_tensors=20)
    with pytest.raises(DecodeError, match="20 tensors, limit 19"):
        decode_with(frame, max_tensors=19)


def test_max_tensor_sets() -> None:
    frame = model_frame({"w": np.ones(2, np.float32)}, sets=3)
    decode_with(frame, max_tensor_sets=3)
    with pytest.raises(DecodeError, match="3 tensor sets, limit 2"):
        decode_with(frame, max_tensor_sets=2)


def test_max_dims() -> None:
    frame = model_frame({"w": np.ones((1,) * 6, np.float32)})
    decode_with(frame, max_dims=6)
    with pytest.raises(DecodeError, match="6 dims, limit 5"):
        decode_with(frame, max_dims=5)


def test_max_elements_checked_before_any_allocation() -> None:
    frame = model_frame({"w": np.ones((10, 10), np.float32)})
    decode_with(frame, max_elements=100)
    with pytest.raises(DecodeError, match="100 elements, limit 99"):
        decode_with(frame, max_elements=99)
    huge = raw_tensor_frame(["w", [1 << 30, 1 << 30], "float32", "fp32", 0, b"", None])
    with pytest.raises(DecodeError, match="elements, limit"):
        Codec().decode(huge)


def test_max_total_elements() -> None:
    frame = model_frame({"a": np.ones(60, np.float32), "b": np.ones(40, np.float32)})
    decode_with(frame, max_total_elements=100)
    with pytest.raises(DecodeError, match="100 elements in total, limit 99"):
        decode_with(frame, max_total_elements=99)


def test_max_name_bytes() -> None:
    frame = model_frame({"é" * 10: np.ones(1, np.float32)})
    decode_with(frame, max_name_bytes=20)
    with pytest.raises(DecodeError, match="longer than 19 bytes"):
        decode_with(frame, max_name_bytes=19)


def test_max_array_len() -> None:
    frame = model_frame({f"t{i}": np.ones(1, np.float32) for i in range(40)})
    decode_with(frame, max_array_len=40)
    with pytest.raises(DecodeError, match="bad msgpack"):
        decode_with(frame, max_array_len=39)


def test_max_map_len() -> None:
    frame = model_frame({"w": np.ones(1, np.float32)}, sets=12)
    decode_with(frame, max_map_len=12)
    with pytest.raises(DecodeError, match="bad msgpack"):
        decode_with(frame, max_map_len=11)


def test_allowed_dtypes() -> None:
    frame = model_frame({"steps": np.array(3, np.int64), "w": np.ones(2, np.float32)})
    decode_with(frame, allowed_dtypes=frozenset({"int64", "float32"}))
    with pytest.raises(DecodeError, match="dtype 'int64' is not allowed"):
        decode_with(frame, allowed_dtypes=frozenset({"float32"}))
    for dtype in ("object", "complex64", "<f4", "float16", 3):
        with pytest.raises(DecodeError, match="not allowed"):
            Codec().decode(raw_tensor_frame(["x", [1], dtype, "raw", 0, b"\0" * 4, None]))


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (["w", [3], "float32", "fp32", 0, b"\0" * 11, None], "11 data bytes, expected 12"),
        (["w", [3], "float32", "fp16", 0, b"\0" * 8, None], "8 data bytes, expected 6"),
        (["w", [3], "float32", "fp8", 0, b"\0" * 3, None], "unknown encoding"),
        (["w", [3], "float32", "fp32", 4, b"\0" * 12, None], "bad flags"),
        (["w", [3], "float32", "fp32", 0, b"\0" * 12, [b"", b""]], "no parameters"),
        (["w", [3], "int64", "fp32", 0, b"\0" * 12, None], "decodes to float32"),
        (["w", [2, 3], "float32", "int8_ch", 0, b"\0" * 6, None], "needs \\[scale, offset\\]"),
        (["w", [2, 3], "float32", "int8_ch", 0, b"\0" * 6, [b"\0" * 4, b"\0" * 4]], "expected 2"),
        (["w", [3], "float32", "int4_ch", 0, b"\0\xf0", [b"\0" * 4, b"\0" * 4]], "padding"),
        (["m", [3], "bool", "raw", 0, b"\x01\x00\x02", None], "bool bytes must be 0 or 1"),
        (["m", [2], "bool", "raw", 1, b"\xff\x00", None], "bool bytes must be 0 or 1"),
        (["w", [1], "float32", "int8", 0, b"\0", [np.float32(-1).tobytes(), b"\0" * 4]], ">= 0"),
        (["w", [1], "float32", "int8", 1, b"\0", [b"\0" * 4, b"\0" * 4]], "float encodings only"),
        (["w", [-1], "float32", "fp32", 0, b"", None], "non-negative"),
        (["w", [True], "float32", "fp32", 0, b"\0" * 4, None], "non-negative"),
        (["", [1], "float32", "fp32", 0, b"\0" * 4, None], "non-empty"),
        (["w", [1], "float32", "fp32", 0, "text", None], "binary"),
        (["w", [1], "float32", "fp32", 0], "array of 7"),
    ],
)
def test_inconsistent_tensors_are_rejected(tensor: list[object], message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        Codec().decode(raw_tensor_frame(tensor))


def test_duplicate_names_and_delta_without_base_are_rejected() -> None:
    t = encode_array("w", np.ones(2, np.float32), "fp32").to_wire()
    with pytest.raises(DecodeError, match="unique"):
        env_frame = raw_tensor_frame(t)
        env = Codec().unpack(Codec().decompress(env_frame))
        env["body"]["sets"]["m"]["tensors"] = [t, t]
        Codec().decode(
            HEADER + zstandard.ZstdCompressor(write_checksum=True).compress(msgpack.packb(env))
        )


# -- ReassemblyLimits -----------------------------------------------------------------


def chunks_of(size: int, max_payload: int = 1000, seed: int = 0) -> tuple[bytes, list[bytes]]:
    frame = HEADER + np.random.default_rng(seed).bytes(size)
    return frame, split_frame(frame, max_payload)


def test_max_transfer_bytes() -> None:
    frame, chunks = chunks_of(5000)
    Reassembler(ReassemblyLimits(max_transfer_bytes=len(frame))).feed("a", chunks[0])
    with pytest.raises(DecodeError, match="limit 5035"):
        Reassembler(ReassemblyLimits(max_transfer_bytes=len(frame) - 1)).feed("a", chunks[0])


def test_max_chunks() -> None:
    _, chunks = chunks_of(5000)
    Reassembler(ReassemblyLimits(max_chunks=len(chunks))).feed("a", chunks[0])
    with pytest.raises(DecodeError, match="chunks, limit"):
        Reassembler(ReassemblyLimits(max_chunks=len(chunks) - 1)).feed("a", chunks[0])


def test_max_pending_transfers_evicts_the_oldest_of_the_biggest_source() -> None:
    r = Reassembler(ReassemblyLimits(max_pending_transfers=2))
    transfers = [chunks_of(3000, seed=i)[1] for i in range(3)]
    r.feed("a", transfers[0][0])
    r.feed("a", transfers[1][0])
    assert r.feed("a", transfers[2][0]) is None  # room made: transfer 0 evicted
    assert r.pending_transfers == 2
    assert all(r.feed("a", c) is None for c in transfers[0][1:])  # ignored, not restarted
    assert r.pending_transfers == 2
    out = [r.feed("a", c) for c in transfers[1][1:]]
    assert out[-1] is not None and r.pending_transfers == 1


def test_max_pending_bytes() -> None:
    r = Reassembler(ReassemblyLimits(max_pending_bytes=1500))
    _, chunks = chunks_of(5000)
    r.feed("a", chunks[0])
    with pytest.raises(QuotaError, match="does not fit"):
        r.feed("a", chunks[1])
    assert r.pending_bytes == 0 and r.pending_transfers == 0  # the transfer is dropped
    assert r.feed("a", chunks[2]) is None and r.pending_bytes == 0  # and stays dropped


def test_timeout_drops_stalled_transfers() -> None:
    now = [0.0]
    r = Reassembler(ReassemblyLimits(timeout_s=10), clock=lambda: now[0])
    frame, chunks = chunks_of(3000)
    r.feed("a", chunks[0])
    now[0] = 10.5
    assert r.expire() == 1 and r.pending_transfers == 0 and r.pending_bytes == 0
    outs = [r.feed("a", c) for c in chunks]  # a fresh start after expiry completes
    assert outs[-1] == frame


def test_remember_dropped_bounds_the_memory_of_dropped_transfers() -> None:
    # Prepare: room for one byte of chunk data per source, so each transfer is dropped
    r = Reassembler(ReassemblyLimits(remember_dropped=1, max_source_bytes=1))
    first, second = chunks_of(2500, seed=1)[1], chunks_of(2500, seed=2)[1]
    for transfer in (first, second):
        with pytest.raises(QuotaError):
            r.feed("a", transfer[0])
    # Execute / Assert: the newest dropped transfer is remembered (its chunk ignored), the
    # one before it forgotten (its chunk is refused again: one error more, no buffer)
    assert r.feed("a", second[1]) is None and r.pending_transfers == 0
    with pytest.raises(QuotaError):
        r.feed("a", first[1])


def test_chunks_of_a_completed_transfer_are_ignored_by_their_send_time() -> None:
    # Prepare: two transfers of one source completed, a third in flight
    r = Reassembler()
    old, done = chunks_of(2500, seed=1)[1], chunks_of(2500, seed=2)[1]
    live_frame, live = chunks_of(2500, seed=3)
    assert [r.feed("a", c) for c in old][-1] is not None
    assert [r.feed("a", c) for c in done][-1] is not None
    assert r.feed("a", live[0]) is None and r.pending_transfers == 1
    # Execute: the completed transfers replayed whole, then the rest of the live one
    replays = [r.feed("a", c) for c in [*old, *done, *reversed(old)]]
    rest = [r.feed("a", c) for c in live[1:]]
    # Assert: nothing of the replays took a buffer or completed; another source's
    # transfers are not ordered by this one's
    assert replays == [None] * len(replays)
    assert rest[-1] == live_frame and r.pending_transfers == 0
    assert [r.feed("b", c) for c in old][-1] is not None


def test_replayed_transfers_never_evict_a_newer_one_in_flight() -> None:
    # Prepare: a source's quota of 2 transfers; earlier genuine transfers recorded
    r = Reassembler(ReassemblyLimits(max_source_transfers=2))
    recorded = [chunks_of(2500, seed=s)[1] for s in range(4)]
    live_frame, live = chunks_of(2500, seed=9)
    r.feed("a", live[0])
    # Execute: the first chunks of every recorded transfer (sent before the live one)
    replays = [r.feed("a", t[0]) for t in recorded]
    rest = [r.feed("a", c) for c in live[1:]]
    # Assert: each was refused room (never stored), the live transfer completes
    assert replays == [None] * 4
    assert rest[-1] == live_frame and r.pending_transfers == 0


def test_a_newer_transfer_evicts_the_one_sent_first() -> None:
    # Prepare: a quota of 2, filled by two transfers
    r = Reassembler(ReassemblyLimits(max_source_transfers=2))
    first, second, third = (chunks_of(2500, seed=s) for s in range(3))
    r.feed("a", first[1][0])
    r.feed("a", second[1][0])
    # Execute: a third, newer transfer
    r.feed("a", third[1][0])
    # Assert: the one sent first was evicted (its chunks now ignored)
    assert r.feed("a", first[1][1]) is None and r.pending_transfers == 2
    assert [r.feed("a", c) for c in second[1][1:]][-1] == second[0]
    assert [r.feed("a", c) for c in third[1][1:]][-1] == third[0]


def test_max_transfer_age_ignores_transfers_sent_before_the_window() -> None:
    # Prepare: a receiver whose clock is 11 s past the transfers' send time
    frame, chunks = chunks_of(2500)
    sent_s = transfer_sent_ms(chunks[0][36:52]) / 1000
    late = Reassembler(ReassemblyLimits(max_transfer_age_s=10), wall_clock=lambda: sent_s + 11)
    on_time = Reassembler(ReassemblyLimits(max_transfer_age_s=10), wall_clock=lambda: sent_s + 9)
    # Execute / Assert
    assert [late.feed("a", c) for c in chunks] == [None] * len(chunks)
    assert late.pending_transfers == 0
    assert [on_time.feed("a", c) for c in chunks][-1] == frame


def test_transfer_ids_carry_strictly_increasing_send_times() -> None:
    frame = HEADER + bytes(3000)
    ids = [split_frame(frame, 1000)[0][36:52] for _ in range(50)]
    times = [transfer_sent_ms(i) for i in ids]
    assert times == sorted(set(times))  # strictly increasing, even within a millisecond
    assert abs(times[0] / 1000 - time.time()) < 60
