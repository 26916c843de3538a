"""Deltas on the wire: round trips, the zero-centred grid's bound, budgets, base lookup,
and error feedback over many rounds."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import deltas
from protocol.arrays import content_fingerprint
from protocol.deltas import (
    UnknownBaseError,
    apply_delta_set,
    decode_sets,
    encode_delta,
    encode_full,
    fit_delta,
    set_base,
    shared_fingerprint,
)
from protocol.errors import DecodeError, EncodeError
from protocol.tensors import Encoding
from protocol.tensorset import TensorSet

STEPS = {Encoding.INT8_CH: 127, Encoding.INT4_CH: 7}


def model(seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": (scale * rng.normal(size=(6, 3, 3, 3))).astype(np.float32),
        "conv.bias": (scale * rng.normal(size=(6,))).astype(np.float32),
        "fc.weight": (scale * rng.normal(size=(10, 24))).astype(np.float32),
        "bn.num_batches_tracked": np.array(seed, dtype=np.int64),
    }


def moved(base: dict[str, np.ndarray], seed: int, step: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, value in base.items():
        if value.dtype.kind == "f":
            out[name] = (value + step * rng.laplace(size=value.shape)).astype(np.float32)
        else:
            out[name] = value + 1
    return out


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16", "int8", "int4"])
def test_the_receiver_decodes_exactly_what_the_sender_says_it_will(precision: str) -> None:
    base = model(0)
    target = moved(base, 1, 0.01)
    encoded = encode_delta(target, base, content_fingerprint(base), precision)

    assert encoded.tensors.mode == "delta" and encoded.tensors.base == content_fingerprint(base)
    received = apply_delta_set(TensorSet.model_validate(encoded.tensors.model_dump()), base)
    for name, value in received.items():
        np.testing.assert_array_equal(value, encoded.received[name])
    assert received["bn.num_batches_tracked"] == target["bn.num_batches_tracked"]
    assert encoded.fingerprint == content_fingerprint(received)
    if precision == "fp32":
        for name in ("conv.weight", "fc.weight"):
            np.testing.assert_allclose(received[name], target[name], atol=1e-6)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_integer_deltas_use_a_zero_centred_grid_within_half_a_step(precision: str) -> None:
    base = model(0)
    target = moved(base, 2, 0.05)
    encoded = encode_delta(target, base, "0123456789abcdef", precision)

    for tensor in encoded.tensors:
        if len(tensor.shape) < 2:
            continue
        steps = STEPS[tensor.encoding]
        delta = (target[tensor.name] - base[tensor.name]).reshape(tensor.shape[0], -1)
        scale = np.frombuffer(tensor.scale, "<f4")
        offset = np.frombuffer(tensor.offset, "<f4")
        np.testing.assert_allclose(scale, np.abs(delta).max(axis=1) / steps, rtol=1e-6)
        np.testing.assert_array_equal(offset, -(steps + 1) * scale)  # code steps+1 is 0
        got = tensor.to_array().reshape(delta.shape)
        assert (np.abs(got - delta) <= scale[:, None] / 2 * (1 + 1e-5) + 1e-12).all()


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    cols=st.integers(1, 40),
    magnitude=st.floats(1e-6, 1e3),
    zeros=st.booleans(),
)
def test_zero_deltas_stay_exact_zeros(rows: int, cols: int, magnitude: float, zeros: bool) -> None:
    rng = np.random.default_rng(rows * 100 + cols)
    delta = (magnitude * rng.normal(size=(rows, cols))).astype(np.float32)
    if zeros:
        delta[0] = 0.0
    delta[:, 0] = 0.0
    base = {"w": np.zeros((rows, cols), np.float32)}
    for precision in ("int8", "int4"):
        got = encode_delta({"w": delta}, base, "0123456789abcdef", precision).received["w"]
        assert (got[:, 0] == 0).all()
        if zeros:
            assert (got[0] == 0).all()


def test_keep_sends_only_the_largest_elements() -> None:
    base = model(0)
    target = moved(base, 3, 0.1)
    encoded = encode_delta(target, base, set_base("student"), "int4", keep=0.2)

    got = encoded.received["fc.weight"] - base["fc.weight"]
    delta = target["fc.weight"] - base["fc.weight"]
    nonzero = np.flatnonzero(got)
    assert 0 < nonzero.size <= 0.2 * delta.size + 1
    kept = np.abs(delta).reshape(-1)[nonzero]
    assert kept.min() >= np.quantile(np.abs(delta), 0.8) * (1 - 1e-6)
    with pytest.raises(EncodeError, match="keep"):
        encode_delta(target, base, set_base("student"), "int4", keep=0.0)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_fit_delta_stays_within_its_budget(precision: str) -> None:
    rng = np.random.default_rng(7)
    student = {"w": rng.normal(size=(64, 300)).astype(np.float32)}
    teacher = {"w": student["w"] + 0.05 * rng.laplace(size=(64, 300)).astype(np.float32)}
    full = encode_full(student, precision).tensors.nbytes
    budget = int(0.3 * full)

    fitted = fit_delta(teacher, student, set_base("student"), precision, budget)

    packed = b"".join(t.data + t.scale + t.offset for t in fitted.tensors)
    assert len(zstandard.ZstdCompressor(level=3).compress(packed)) <= budget
    error = np.abs(fitted.received["w"] - teacher["w"]).mean()
    assert error < np.abs(teacher["w"] - student["w"]).mean()  # the teacher is closer


def test_decode_sets_resolves_set_and_held_bases() -> None:
    held = model(0)
    student_target = moved(held, 1, 0.01)
    teacher_target = moved(student_target, 2, 0.01)
    student = encode_delta(student_target, held, content_fingerprint(held), "int8")
    teacher = encode_delta(teacher_target, student.received, set_base("student"), "int8")
    sets = {"student": student.tensors, "teacher": teacher.tensors}

    out = decode_sets(sets, ["student", "teacher"], held)

    for name in held:
        np.testing.assert_array_equal(out["student"][name], student.received[name])
        np.testing.assert_array_equal(out["teacher"][name], teacher.received[name])
    with pytest.raises(UnknownBaseError, match="not held"):
        decode_sets(sets, ["student"], model(9))
    with pytest.raises(UnknownBaseError):
        decode_sets(sets, ["teacher"], held)  # its base set was not decoded first
    with pytest.raises(DecodeError, match="no set"):
        decode_sets(sets, ["global"], held)
    wrong = {k: v for k, v in held.items() if k != "conv.bias"}
    with pytest.raises(DecodeError, match="differ"):
        apply_delta_set(student.tensors, wrong)


@pytest.mark.parametrize("precision", ["int8", "int4", "fp16"])
def test_error_feedback_keeps_the_sum_of_sent_deltas_on_track(precision: str) -> None:
    """Over many rounds the receiver's sum of decoded deltas stays within one
    quantization step of the true sum with error feedback; without it the error grows."""
    rng = np.random.default_rng(11)
    shape = (16, 50)
    zero = {"w": np.zeros(shape, np.float32)}
    true_sum = np.zeros(shape, np.float64)
    fed_sum = np.zeros(shape, np.float64)
    plain_sum = np.zeros(shape, np.float64)
    residual = None
    largest_step = 0.0
    for _ in range(200):
        # small biased updates: the worst case for round-to-nearest without feedback
        delta = (0.002 + 0.01 * rng.normal(size=shape)).astype(np.float32)
        true_sum += delta
        with_feedback = encode_delta(
            {"w": delta}, zero, "0123456789abcdef", precision, residual=residual
        )
        residual = with_feedback.residual
        fed_sum += with_feedback.received["w"]
        plain_sum += encode_delta({"w": delta}, zero, "0123456789abcdef", precision).received["w"]
        largest_step = max(largest_step, float(np.abs(delta + residual["w"]).max()))

    fed_error = np.abs(fed_sum - true_sum).max()
    plain_error = np.abs(plain_sum - true_sum).max()
    # with feedback the gap is the last residual, bounded by half a step of the last round
    np.testing.assert_allclose(fed_sum - true_sum, -residual["w"], atol=1e-4)
    if precision != "fp16":
        steps = 127 if precision == "int8" else 7
        assert fed_error <= largest_step / steps + 1e-4
    assert fed_error < plain_error


def test_a_shared_decoding_is_made_once_per_set_object_and_read_only() -> None:
    student = model(1)
    sets = {
        "student": encode_full(student, "int8").tensors,
        "teacher": encode_delta(
            moved(student, 2, 0.1), student, set_base("student"), "int8"
        ).tensors,
    }
    first = decode_sets(sets, ["student", "teacher"], shared=True)
    second = decode_sets(sets, ["student", "teacher"], shared=True)
    for name in ("student", "teacher"):  # the same arrays, not writable
        for key, value in first[name].items():
            assert second[name][key] is value
            assert not value.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        first["student"]["conv.bias"][0] = 1.0
    unshared = decode_sets(sets, ["student", "teacher"])  # new and writable, same values
    for name in ("student", "teacher"):
        for key, value in unshared[name].items():
            assert value.flags.writeable and value is not first[name][key]
            np.testing.assert_array_equal(value, first[name][key])
    assert shared_fingerprint(sets["student"]) == content_fingerprint(first["student"])
    # an equal set that is another object decodes anew; one not decoded shared has no
    # shared fingerprint; a set no longer alive is forgotten
    again = {"student": TensorSet.model_validate(sets["student"].model_dump())}
    assert shared_fingerprint(again["student"]) is None
    key = id(again["student"])
    assert key not in deltas._SHARED
    other = decode_sets(again, shared=True)["student"]
    assert other["conv.bias"] is not first["student"]["conv.bias"]
    assert shared_fingerprint(again["student"]) == shared_fingerprint(sets["student"])
    assert key in deltas._SHARED
    del again
    gc.collect()  # (other tests' sets may be collected too: only this key is checked)
    assert key not in deltas._SHARED
