"""Every tensor encoding: round trips, documented error bounds, edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protocol.arrays import apply_delta, content_fingerprint, delta_arrays
from protocol.errors import EncodeError
from protocol.limits import DecodeLimits
from protocol.tensors import EncodedTensor, Encoding, encode_array, encoding_for
from protocol.tensorset import encode_tensors

LIMITS = DecodeLimits()
FLOAT_ENCODINGS = [Encoding.FP32, Encoding.FP16, Encoding.BF16]
INT_ENCODINGS = [Encoding.INT8, Encoding.INT8_CH, Encoding.INT4_CH]
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)
finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)


def wire_round_trip(t: EncodedTensor) -> np.ndarray:
    return EncodedTensor.from_wire(t.to_wire(), LIMITS).to_array()


def affine_bound(x: np.ndarray, encoding: Encoding) -> np.ndarray:
    """Documented per-element bound: scale / 2 of the element's channel (+ f32 rounding)."""
    levels = 16 if encoding is Encoding.INT4_CH else 256
    rows = (
        x.reshape(1, -1) if encoding is Encoding.INT8 or x.ndim < 2 else x.reshape(x.shape[0], -1)
    )
    span = rows.max(axis=1).astype(np.float64) - rows.min(axis=1)
    bound = span / (levels - 1) / 2 * (1 + 1e-5) + 2.0**-22 * np.abs(rows).max(axis=1) + 1e-30
    return np.broadcast_to(bound[:, None], rows.shape).reshape(x.shape)


@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float32, shapes, elements=finite), encoding=st.sampled_from(INT_ENCODINGS))
def test_integer_encodings_stay_within_half_a_step(x: np.ndarray, encoding: Encoding) -> None:
    # Execute
    y = wire_round_trip(encode_array("t", x, encoding))
    # Assert
    assert y.shape == x.shape and y.dtype == np.float32
    if x.size:
        assert (np.abs(y.astype(np.float64) - x) <= affine_bound(x, encoding)).all()


@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float32, shapes, elements=finite), shuffle=st.booleans())
def test_fp32_is_exact_and_fp16_bf16_within_relative_bounds(x: np.ndarray, shuffle: bool) -> None:
    # Execute
    exact = wire_round_trip(encode_array("t", x, "fp32", shuffle=shuffle))
    half = wire_round_trip(encode_array("t", x, "fp16", shuffle=shuffle))
    brain = wire_round_trip(encode_array("t", x, "bf16", shuffle=shuffle))
    # Assert
    assert np.array_equal(exact, x)
    ax = np.abs(x.astype(np.float64))
    assert (np.abs(half - x) <= np.maximum(ax * 2.0**-11, 2.0**-25)).all()
    assert (np.abs(brain - x) <= np.maximum(ax * 2.0**-8, 2.0**-134)).all()


@settings(max_examples=40, deadline=None)
@given(
    x=hnp.arrays(
        st.sampled_from(["int64", "int32", "int16", "int8", "uint8", "bool", "float64"]), shapes
    ),
    shuffle=st.booleans(),
)
def test_raw_round_trips_every_allowed_dtype(x: np.ndarray, shuffle: bool) -> None:
    # Execute
    t = encode_array("t", x, "raw", shuffle=shuffle)
    y = wire_round_trip(t)
    # Assert
    assert y.dtype == x.dtype and y.shape == x.shape
    assert np.array_equal(y, x, equal_nan=x.dtype.kind == "f")
    y.reshape(-1)[:0] = 0  # writable


def test_stochastic_rounding_is_unbiased_and_within_one_step() -> None:
    # Prepare
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, size=(4, 64)).astype(np.float32)
    # Execute
    decoded = np.stack([encode_array("t", x, "int4_ch", rng=rng).to_array() for _ in range(2000)])
    # Assert
    scale = (x.max(axis=1) - x.min(axis=1)) / 15
    assert (np.abs(decoded - x) < scale[:, None] * (1 + 1e-5)).all()
    nearest_err = np.abs(encode_array("t", x, "int4_ch").to_array() - x).mean()
    mean_err = np.abs(decoded.mean(axis=0) - x).mean()
    assert mean_err < nearest_err / 5  # averaging stochastic codes converges to x


def test_constant_and_scalar_and_empty_tensors() -> None:
    for encoding in INT_ENCODINGS + FLOAT_ENCODINGS:
        const = np.full((3, 5), 0.7, np.float32)
        assert np.allclose(wire_round_trip(encode_array("c", const, encoding)), const, atol=1e-3)
        scalar = np.float32(-2.5)
        assert wire_round_trip(encode_array("s", scalar, encoding)).shape == ()
        for shape in [(0,), (3, 0), (0, 4, 2)]:
            empty = np.zeros(shape, np.float32)
            assert wire_round_trip(encode_array("e", empty, encoding)).shape == shape


@pytest.mark.parametrize("encoding", INT_ENCODINGS)
def test_subnormal_ranges_quantize_without_nan(encoding: Encoding) -> None:
    # a channel spanning ~1e-40: its scale is subnormal and 1/scale overflows float32
    x = np.array([[0.0, 5e-41, 1e-40, 3e-41], [1.0, 2.0, 3.0, 4.0]], np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        y = encode_array("t", x, encoding).to_array()
    assert (np.abs(y.astype(np.float64) - x) <= affine_bound(x, encoding)).all()


@pytest.mark.parametrize("encoding", INT_ENCODINGS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_integer_encodings_refuse_non_finite_values(encoding: Encoding, bad: float) -> None:
    x = np.ones((2, 3), np.float32)
    x[1, 2] = bad
    with pytest.raises(EncodeError, match="NaN or infinite"):
        encode_array("w", x, encoding)


def test_fp16_refuses_overflow_but_carries_nan_and_inf() -> None:
    with pytest.raises(EncodeError, match="fp16 range"):
        encode_array("w", np.array([1.0, 70000.0], np.float32), "fp16")
    special = np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)
    for encoding in FLOAT_ENCODINGS:
        y = wire_round_trip(encode_array("w", special, encoding))
        assert np.isnan(y[0]) and y[1] == np.inf and y[2] == -np.inf and y[3] == 1.0


def test_bf16_rounds_to_nearest_even() -> None:
    # 1 + 2**-8 lies halfway between bf16 neighbours 1 and 1 + 2**-7: ties go to even (1.0)
    x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-20], np.float32)
    y = encode_array("w", x, "bf16").to_array()
    assert y.tolist() == [1.0, 1 + 2 * 2.0**-7, 1 + 2.0**-7]


def test_byte_shuffle_improves_compression_of_weights() -> None:
    import zstandard

    x = (np.random.default_rng(0).standard_normal(50_000) * 0.05).astype(np.float32)
    plain = encode_array("w", x, "fp32").data
    shuffled = encode_array("w", x, "fp32", shuffle=True).data
    comp = zstandard.ZstdCompressor(level=3)
    assert len(comp.compress(shuffled)) < 0.95 * len(comp.compress(plain))


def test_policy_per_precision() -> None:
    w, b, steps = np.ones((4, 3), np.float32), np.ones(4, np.float32), np.array(3, np.int64)
    assert [encoding_for(p, w) for p in ["fp32", "fp16", "bf16", "int8", "int4"]] == [
        Encoding.FP32,
        Encoding.FP16,
        Encoding.BF16,
        Encoding.INT8_CH,
        Encoding.INT4_CH,
    ]
    assert encoding_for("int4", b) is Encoding.FP16
    assert encoding_for("int8", steps) is Encoding.RAW
    assert encoding_for("fp16", np.array([1e6], np.float32)) is Encoding.FP32


def test_compression_ratios_of_the_integer_encodings() -> None:
    x = (np.random.default_rng(0).standard_normal((64, 576)) * 0.05).astype(np.float32)
    fp32 = encode_array("w", x, "fp32").nbytes
    assert fp32 / encode_array("w", x, "int8_ch").nbytes > 3.9
    assert fp32 / encode_array("w", x, "int4_ch").nbytes > 7.5
    assert fp32 / encode_array("w", x, "fp16").nbytes == 2.0


def test_deltas_and_fingerprints() -> None:
    rng = np.random.default_rng(3)
    base = {"w": rng.standard_normal((3, 4)).astype(np.float32), "n": np.array(5, np.int64)}
    new = {"w": base["w"] + 0.5, "n": np.array(6, np.int64)}
    delta = delta_arrays(new, base)
    assert np.allclose(delta["w"], 0.5) and int(delta["n"]) == 6
    back = apply_delta(base, delta)
    assert np.allclose(back["w"], new["w"]) and int(back["n"]) == 6
    fp = content_fingerprint(base)
    assert fp == content_fingerprint({k: v.copy() for k, v in base.items()})
    assert fp != content_fingerprint(new) and len(fp) == 16
    sent = encode_tensors(delta, "int8", mode="delta", base=fp)
    assert sent.base == fp and sent.mode == "delta"
    with pytest.raises(EncodeError):
        encode_tensors(delta, "int8", mode="delta")
    with pytest.raises(ValueError, match="shape"):
        apply_delta(base, {"w": np.zeros((4, 3), np.float32), "n": base["n"]})


def test_sizes_match_the_layouts() -> None:
    x = np.ones((10, 7), np.float32)
    sizes = {e: len(encode_array("w", x, e).data) for e in FLOAT_ENCODINGS + INT_ENCODINGS}
    assert sizes == {
        Encoding.FP32: 280,
        Encoding.FP16: 140,
        Encoding.BF16: 140,
        Encoding.INT8: 70,
        Encoding.INT8_CH: 70,
        Encoding.INT4_CH: math.ceil(70 / 2),
    }
    assert len(encode_array("w", x, "int8_ch").scale) == 40
