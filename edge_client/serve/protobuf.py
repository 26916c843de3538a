"""The protobuf wire format, as much of it as reading and rewriting an ONNX template needs,
with the standard library and numpy only (the inference device has no ``onnx`` package).

A message is parsed into its :class:`Field` records (where each field's key, payload and
end lie) without decoding payloads, so a writer can copy unknown fields byte for byte.
Every read is bounded: varints of at most 10 bytes, field numbers in range, lengths
within their message, at most :data:`MAX_FIELDS_PER_MESSAGE` fields per message; a
violation raises :class:`~edge_client.errors.OnnxTemplateError` naming ``what`` was read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_client.errors import OnnxTemplateError

__all__ = [
    "I32",
    "I64",
    "LEN",
    "MAX_FIELDS_PER_MESSAGE",
    "VARINT",
    "Field",
    "count_varints",
    "encode_varint",
    "expect_wire",
    "len_field",
    "parse_fields",
    "read_text",
    "read_varint",
    "read_varints",
    "signed64",
]

MAX_FIELDS_PER_MESSAGE = 200_000
"""Most fields one protobuf message (model, graph, node, tensor, ...) may have."""

# Wire types.
VARINT, I64, LEN, I32 = 0, 1, 2, 5
MAX_VARINT_BYTES = 10
MAX_FIELD_NUMBER = (1 << 29) - 1


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a message: where it starts, its payload and where it ends."""

    number: int
    wire: int
    start: int  # offset of the key
    data: int  # offset of the payload (LEN: after the length; fixed: the bytes)
    end: int  # offset past the field
    value: int  # the varint value (wire type 0), else 0


def read_varint(buf: bytes, pos: int, end: int, what: str) -> tuple[int, int]:
    """The unsigned varint at ``pos`` and the offset after it."""
    result = 0
    for i in range(MAX_VARINT_BYTES):
        if pos >= end:
            raise OnnxTemplateError(f"{what}: truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            if i == MAX_VARINT_BYTES - 1 and byte > 1:
                raise OnnxTemplateError(f"{what}: varint overflows 64 bits")
            return result, pos
    raise OnnxTemplateError(f"{what}: varint longer than {MAX_VARINT_BYTES} bytes")


def parse_fields(buf: bytes, start: int, end: int, what: str) -> list[Field]:
    """The fields of the message in ``buf[start:end]``, in order (payloads not parsed)."""
    fields: list[Field] = []
    pos = start
    while pos < end:
        if len(fields) >= MAX_FIELDS_PER_MESSAGE:
            raise OnnxTemplateError(f"{what}: more than {MAX_FIELDS_PER_MESSAGE} fields")
        key_start = pos
        key, pos = read_varint(buf, pos, end, what)
        number, wire = key >> 3, key & 7
        if not 1 <= number <= MAX_FIELD_NUMBER:
            raise OnnxTemplateError(f"{what}: invalid field number {number} at byte {key_start}")
        value = 0
        data = pos
        if wire == VARINT:
            value, pos = read_varint(buf, pos, end, what)
        elif wire in (I64, I32):
            pos += 8 if wire == I64 else 4
        elif wire == LEN:
            length, data = read_varint(buf, pos, end, what)
            if length > end - data:
                raise OnnxTemplateError(
                    f"{what}: field {number} has length {length}, past the end of its message"
                )
            pos = data + length
        else:
            raise OnnxTemplateError(f"{what}: unsupported wire type {wire} at byte {key_start}")
        if pos > end:
            raise OnnxTemplateError(f"{what}: field {number} is truncated")
        fields.append(Field(number, wire, key_start, data, pos, value))
    return fields


def expect_wire(field: Field, wire: int, what: str) -> None:
    if field.wire != wire:
        raise OnnxTemplateError(f"{what}: field {field.number} has wire type {field.wire}")


def read_text(buf: bytes, field: Field, what: str) -> str:
    expect_wire(field, LEN, what)
    try:
        return buf[field.data : field.end].decode("utf-8")
    except UnicodeDecodeError:
        raise OnnxTemplateError(f"{what}: a string is not valid UTF-8") from None


def signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def read_varints(buf: bytes, field: Field, what: str) -> list[int]:
    """The (signed 64-bit) values of a repeated integer field, packed or not."""
    if field.wire == VARINT:
        return [signed64(field.value)]
    expect_wire(field, LEN, what)
    values: list[int] = []
    pos = field.data
    while pos < field.end:
        value, pos = read_varint(buf, pos, field.end, what)
        values.append(signed64(value))
    return values


def count_varints(buf: bytes, field: Field, what: str) -> int:
    """Number of values in a repeated varint field (packed or not), validated cheaply."""
    if field.wire == VARINT:
        return 1
    expect_wire(field, LEN, what)
    payload = np.frombuffer(buf, dtype=np.uint8, count=field.end - field.data, offset=field.data)
    if len(payload) and payload[-1] >= 0x80:
        raise OnnxTemplateError(f"{what}: truncated packed varints")
    return int(np.count_nonzero(payload < 0x80))


def encode_varint(value: int) -> bytes:
    """Protobuf varint of ``value`` (negative values as 64-bit two's complement)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def len_field(number: int, payload: bytes) -> bytes:
    return encode_varint(number << 3 | LEN) + encode_varint(len(payload)) + payload
