"""The explicit public surface of `protocol`."""

from __future__ import annotations

import protocol


def test_every_name_in_all_resolves_and_is_unique() -> None:
    assert len(set(protocol.__all__)) == len(protocol.__all__)
    missing = [name for name in protocol.__all__ if not hasattr(protocol, name)]
    assert missing == []


def test_public_classes_and_functions_are_all_exported() -> None:
    public = {
        name
        for name, value in vars(protocol).items()
        if not name.startswith("_") and (isinstance(value, type) or callable(value))
    }
    assert public <= set(protocol.__all__)


def test_errors_form_one_tree() -> None:
    for name in ("DecodeError", "EncodeError", "TransportError", "BrokerError"):
        assert issubclass(getattr(protocol, name), protocol.ProtocolError)
    assert issubclass(protocol.DecodeError, ValueError)
    assert issubclass(protocol.TransportError, OSError)
