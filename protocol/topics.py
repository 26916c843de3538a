"""The MQTT topic layout, one tree per fleet under ``fl/{fleet}/``.

==========================================  ===========  ===============================
topic                                       publisher    payload kinds
==========================================  ===========  ===============================
``fl/{fleet}/devices/{device}/hello``       device       hello
``fl/{fleet}/devices/{device}/update``      device       update
``fl/{fleet}/devices/{device}/status``      device       device_status (retained, will)
``fl/{fleet}/to/{device}/task``             coordinator  task
``fl/{fleet}/to/{device}/model``            coordinator  model (for one device)
``fl/{fleet}/to/{device}/ack``              coordinator  ack
``fl/{fleet}/broadcast/model``              coordinator  model (same for every device)
``fl/{fleet}/coordinator/status``           coordinator  coord_status (retained, will)
==========================================  ===========  ===============================

Every topic a device publishes to contains its device id, so a broker ACL such as
Mosquitto's ``pattern write fl/FLEET/devices/%u/#`` plus ``pattern read fl/FLEET/to/%u/#``
confines each device to its own topics (the deployment kit writes one: deploy/mosquitto/acl,
docs/deploy.md). The coordinator checks that a message's ``sender`` equals the device id in
its topic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from protocol.errors import DecodeError
from protocol.messages import ID_PATTERN

__all__ = ["DEVICE_LEAVES", "DOWN_LEAVES", "TopicInfo", "Topics", "parse_topic", "valid_identifier"]

PREFIX = "fl"
DEVICE_LEAVES = ("hello", "update", "status")
DOWN_LEAVES = ("task", "model", "ack")
_ID = re.compile(ID_PATTERN)

DeviceLeaf = Literal["hello", "update", "status"]
DownLeaf = Literal["task", "model", "ack"]


def valid_identifier(value: str) -> bool:
    """Whether ``value`` may be a fleet name or device id (see protocol.messages)."""
    return bool(_ID.match(value))


def _check_id(what: str, value: str) -> str:
    if not valid_identifier(value):
        raise ValueError(
            f"invalid {what} {value!r}: 1-64 of A-Z a-z 0-9 _ . -, starting alphanumeric"
        )
    return value


class Topics:
    """Topic names and subscription filters of one fleet."""

    def __init__(self, fleet: str) -> None:
        self.fleet = _check_id("fleet name", fleet)
        self.root = f"{PREFIX}/{fleet}"

    def device(self, device_id: str, leaf: DeviceLeaf) -> str:
        """A topic a device publishes to."""
        if leaf not in DEVICE_LEAVES:
            raise ValueError(f"unknown device topic {leaf!r}")
        return f"{self.root}/devices/{_check_id('device id', device_id)}/{leaf}"

    def to_device(self, device_id: str, leaf: DownLeaf) -> str:
        """A topic the coordinator publishes to for one device."""
        if leaf not in DOWN_LEAVES:
            raise ValueError(f"unknown downlink topic {leaf!r}")
        return f"{self.root}/to/{_check_id('device id', device_id)}/{leaf}"

    @property
    def broadcast_model(self) -> str:
        return f"{self.root}/broadcast/model"

    @property
    def coordinator_status(self) -> str:
        return f"{self.root}/coordinator/status"

    def from_devices(self, leaf: DeviceLeaf | Literal["#"] = "#") -> str:
        """Filter the coordinator subscribes with: one leaf of every device, or all."""
        if leaf == "#":
            return f"{self.root}/devices/#"
        return f"{self.root}/devices/+/{leaf}"

    def device_inbox(self, device_id: str) -> str:
        """Filter a device subscribes with for messages addressed to it."""
        return f"{self.root}/to/{_check_id('device id', device_id)}/#"

    @property
    def broadcast(self) -> str:
        """Filter a device subscribes with for fleet-wide messages."""
        return f"{self.root}/broadcast/#"


@dataclass(frozen=True, slots=True)
class TopicInfo:
    """What a topic of the layout says: fleet, direction, device and leaf."""

    fleet: str
    role: Literal["device", "to", "broadcast", "coordinator"]
    device_id: str | None
    leaf: str


def parse_topic(topic: str) -> TopicInfo:
    """Parse a topic of the layout.

    Raises:
        DecodeError: the topic is not part of the layout.
    """
    parts = topic.split("/")
    if len(parts) < 4 or parts[0] != PREFIX or not valid_identifier(parts[1]):
        raise DecodeError(f"topic {topic!r} is not in the fl/{{fleet}}/... layout")
    fleet, role = parts[1], parts[2]
    if role in ("devices", "to") and len(parts) == 5 and valid_identifier(parts[3]):
        leaves = DEVICE_LEAVES if role == "devices" else DOWN_LEAVES
        if parts[4] in leaves:
            return TopicInfo(fleet, "device" if role == "devices" else "to", parts[3], parts[4])
    if len(parts) == 4 and (role, parts[3]) in (("broadcast", "model"), ("coordinator", "status")):
        return TopicInfo(fleet, role, None, parts[3])  # type: ignore[arg-type]
    raise DecodeError(f"topic {topic!r} is not in the fl/{{fleet}}/... layout")
