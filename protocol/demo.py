"""The wire demo: a model at every precision, through a real (embedded) MQTT broker."""

from __future__ import annotations

import queue
import time
from typing import Any

import numpy as np

from protocol.channel import Channel
from protocol.codec import Codec
from protocol.messages import Message, ModelPayload
from protocol.samples import sample_weights
from protocol.tensors import Precision
from protocol.tensorset import encode_tensors
from protocol.topics import Topics
from protocol.transport.broker import EmbeddedBroker
from protocol.transport.mqtt import MqttConfig, MqttTransport

__all__ = ["run_demo"]


def run_demo(
    model: str = "lenet5", *, level: int = 3, max_payload: int = 128 * 1024
) -> list[dict[str, Any]]:
    """Publish one model message per precision from a coordinator to a device.

    Returns one row per precision: payload and MQTT wire bytes, chunks, size ratio
    against fp32, the largest absolute weight error after decoding, and the time from
    encode to decoded delivery in milliseconds.

    Raises:
        TransportError: the broker or a client failed.
    """
    weights = sample_weights(model)
    topics = Topics("demo")
    topic = topics.to_device("dev-000", "model")
    codec = Codec(level=level)
    rows: list[dict[str, Any]] = []
    inbox: queue.Queue[Message] = queue.Queue()
    with EmbeddedBroker() as broker:
        coordinator = MqttTransport(MqttConfig.from_url(broker.url, client_id="coordinator"))
        device = MqttTransport(MqttConfig.from_url(broker.url, client_id="dev-000"))
        with coordinator, device:
            coordinator.connect()
            device.connect()
            receiver = Channel(device, codec, max_payload=max_payload)
            receiver.subscribe(topics.device_inbox("dev-000"), lambda _t, m: inbox.put(m))
            sender = Channel(coordinator, codec, max_payload=max_payload)
            for precision in Precision:  # fp32 first: the reference of the ratio
                start = time.perf_counter()
                sets = {"global": encode_tensors(weights, precision)}
                message = Message(fleet="demo", sender="coordinator", body=ModelPayload(sets=sets))
                before = coordinator.stats.totals("out")
                sent = sender.send(topic, message)
                got = inbox.get(timeout=30)
                elapsed = (time.perf_counter() - start) * 1000
                after = coordinator.stats.totals("out")
                decoded = got.tensor_sets()["global"].to_arrays()
                error = max(float(np.max(np.abs(decoded[k] - v))) for k, v in weights.items())
                rows.append(
                    {
                        "precision": precision.value,
                        "payload_bytes": sent.payload_bytes,
                        "wire_bytes": after.wire_bytes - before.wire_bytes,
                        "chunks": sent.frames,
                        "ratio_vs_fp32": (rows[0]["payload_bytes"] if rows else sent.payload_bytes)
                        / sent.payload_bytes,
                        "max_abs_error": error,
                        "round_trip_ms": elapsed,
                    }
                )
    return rows
