"""Golden bytes for PUBLISH packet sizes: hand-built packets, and what paho really sends."""

from __future__ import annotations

import socket
import threading

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from protocol.errors import EncodeError
from protocol.transport import MqttVersion, publish_packet_size, varint_size

V311, V5 = MqttVersion.V311, MqttVersion.V5


def golden(
    header: int, remaining: bytes, topic: bytes, packet_id: bytes, props: bytes, payload: bytes
) -> bytes:
    """A PUBLISH packet written out field by field (remaining length given as literal bytes)."""
    return (
        bytes([header])
        + remaining
        + len(topic).to_bytes(2, "big")
        + topic
        + packet_id
        + props
        + payload
    )


# (topic, payload, qos, version, expected packet). Remaining lengths are literal golden
# bytes: 0x7f = 127, 0x80 0x01 = 128, 0xff 0x7f = 16383, 0x80 0x80 0x01 = 16384,
# 0xff 0xff 0x7f = 2097151, 0x80 0x80 0x80 0x01 = 2097152.
CASES = [
    ("a/b", b"hi", 0, V311, golden(0x30, b"\x07", b"a/b", b"", b"", b"hi")),
    ("a/b", b"hi", 1, V311, golden(0x32, b"\x09", b"a/b", b"\x00\x01", b"", b"hi")),
    ("a/b", b"hi", 0, V5, golden(0x30, b"\x08", b"a/b", b"", b"\x00", b"hi")),
    ("a/b", b"hi", 1, V5, golden(0x32, b"\x0a", b"a/b", b"\x00\x01", b"\x00", b"hi")),
    ("a/b", b"", 1, V311, golden(0x32, b"\x07", b"a/b", b"\x00\x01", b"", b"")),
    ("t", b"x" * 124, 0, V311, golden(0x30, b"\x7f", b"t", b"", b"", b"x" * 124)),
    ("t", b"x" * 125, 0, V311, golden(0x30, b"\x80\x01", b"t", b"", b"", b"x" * 125)),
    ("t", b"x" * 121, 1, V5, golden(0x32, b"\x7f", b"t", b"\x00\x01", b"\x00", b"x" * 121)),
    ("t", b"x" * 122, 1, V5, golden(0x32, b"\x80\x01", b"t", b"\x00\x01", b"\x00", b"x" * 122)),
    ("t", b"y" * 16_380, 0, V311, golden(0x30, b"\xff\x7f", b"t", b"", b"", b"y" * 16_380)),
    ("t", b"y" * 16_381, 0, V311, golden(0x30, b"\x80\x80\x01", b"t", b"", b"", b"y" * 16_381)),
    (
        "t",
        b"z" * 2_097_148,
        0,
        V311,
        golden(0x30, b"\xff\xff\x7f", b"t", b"", b"", b"z" * 2_097_148),
    ),
    (
        "t",
        b"z" * 2_097_149,
        0,
        V311,
        golden(0x30, b"\x80\x80\x80\x01", b"t", b"", b"", b"z" * 2_097_149),
    ),
    (
        "fl/é",
        b"\x00\xff",
        1,
        V311,
        golden(0x32, b"\x0b", "fl/é".encode(), b"\x00\x01", b"", b"\x00\xff"),
    ),
]
IDS = [f"{c[3].name}-q{c[2]}-{len(c[1])}B-{c[0]}" for c in CASES]


@pytest.mark.parametrize(("topic", "payload", "qos", "version", "packet"), CASES, ids=IDS)
def test_size_matches_golden_packet(
    topic: str, payload: bytes, qos: int, version: MqttVersion, packet: bytes
) -> None:
    assert publish_packet_size(topic, len(payload), qos, version) == len(packet)


def _read_packet(conn: socket.socket) -> bytes:
    def read_exactly(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            assert chunk, "peer closed the connection mid-packet"
            data += chunk
        return bytes(data)

    packet = bytearray(read_exactly(1))
    remaining, shift = 0, 0
    while True:
        byte = read_exactly(1)[0]
        packet.append(byte)
        remaining |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return bytes(packet) + read_exactly(remaining)


def paho_publish_bytes(topic: str, payload: bytes, qos: int, version: MqttVersion) -> bytes:
    """Let paho connect to a bare loopback server and return the PUBLISH it writes."""
    v5 = version is V5
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(5)
        client = paho.Client(
            callback_api_version=CallbackAPIVersion.VERSION2,
            client_id="golden",
            protocol=paho.MQTTv5 if v5 else paho.MQTTv311,
        )
        client.connect("127.0.0.1", server.getsockname()[1])  # writes CONNECT right away
        conn, _ = server.accept()
        with conn:
            conn.settimeout(5)
            assert _read_packet(conn)[0] == 0x10  # CONNECT
            conn.sendall(b"\x20\x03\x00\x00\x00" if v5 else b"\x20\x02\x00\x00")
            client.loop(timeout=2)
            assert client.is_connected()
            captured: list[bytes] = []
            reader = threading.Thread(target=lambda: captured.append(_read_packet(conn)))
            reader.start()
            client.publish(topic, payload, qos=qos)
            while reader.is_alive():
                client.loop_write()
                reader.join(0.001)
        sock = client.socket()
        if sock is not None:
            sock.close()
    assert captured, "no PUBLISH captured"
    return captured[0]


@pytest.mark.parametrize(("topic", "payload", "qos", "version", "packet"), CASES, ids=IDS)
def test_paho_sends_exactly_the_golden_packet(
    topic: str, payload: bytes, qos: int, version: MqttVersion, packet: bytes
) -> None:
    sent = paho_publish_bytes(topic, payload, qos, version)

    assert sent == packet
    assert len(sent) == publish_packet_size(topic, len(payload), qos, version)


def test_mqtt5_properties_are_counted_with_their_length_prefix() -> None:
    # Payload Format Indicator = 1: property bytes 0x01 0x01, prefixed by their length 0x02.
    packet = golden(0x32, b"\x0c", b"a/b", b"\x00\x01", b"\x02\x01\x01", b"hi")

    assert publish_packet_size("a/b", 2, 1, V5, properties_len=2) == len(packet)


def test_large_properties_grow_both_length_prefixes() -> None:
    base = publish_packet_size("t", 10, 1, V5)  # remaining length 16: one byte

    # 200 bytes of properties: their own length takes 2 bytes and so does the remaining
    # length (16 + 200 + 1 = 217 > 127).
    assert publish_packet_size("t", 10, 1, V5, properties_len=200) == base + 200 + 1 + 1


@pytest.mark.parametrize(
    ("n", "size"),
    [
        (0, 1),
        (127, 1),
        (128, 2),
        (16_383, 2),
        (16_384, 3),
        (2_097_151, 3),
        (2_097_152, 4),
        (268_435_455, 4),
    ],
)
def test_varint_size_boundaries(n: int, size: int) -> None:
    assert varint_size(n) == size


@pytest.mark.parametrize("n", [-1, 268_435_456])
def test_varint_size_rejects_out_of_range(n: int) -> None:
    with pytest.raises(EncodeError):
        varint_size(n)


@pytest.mark.parametrize(
    ("payload_len", "qos", "version", "properties_len"),
    [(-1, 0, V311, 0), (1, 3, V311, 0), (1, 0, V311, 2), (268_435_455, 0, V311, 0)],
)
def test_publish_packet_size_rejects_impossible_packets(
    payload_len: int, qos: int, version: MqttVersion, properties_len: int
) -> None:
    with pytest.raises(EncodeError):
        publish_packet_size("t", payload_len, qos, version, properties_len)
