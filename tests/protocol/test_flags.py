"""Flags derived from settings models (protocol.flags): names, types, choices, defaults,
what was given."""

from __future__ import annotations

import argparse
import enum
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from protocol.flags import ModelFlags, comma_list


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Inner(BaseModel):
    rate: float = 0.5
    """Learning rate."""


class Settings(BaseModel):
    model_config = {"use_attribute_docstrings": True}

    round_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds per round."""
    mode: Literal["dual", "single"] = "dual"
    colour: Colour = Colour.RED
    deltas: bool = True
    """Send deltas."""
    out: Path | None = None
    names: tuple[str, ...] = ()
    count: int = 3
    inner: Inner = Inner()


def parser_for(**options: object) -> tuple[argparse.ArgumentParser, ModelFlags]:
    parser = argparse.ArgumentParser(prog="t")
    flags = ModelFlags()
    flags.add(parser, Settings, **options)  # type: ignore[arg-type]
    return parser, flags


def test_only_the_flags_given_are_returned_nested_as_the_model() -> None:
    parser, flags = parser_for(flags={"round_timeout_s": "--round-timeout"})

    args = parser.parse_args(["--round-timeout", "5", "--no-deltas", "--rate", "0.1"])

    assert flags.given(args) == {"round_timeout_s": 5.0, "deltas": False, "inner": {"rate": 0.1}}
    assert flags.given(parser.parse_args([])) == {}


def test_types_choices_and_lists_come_from_the_annotations() -> None:
    parser, flags = parser_for()

    args = parser.parse_args(
        ["--mode", "single", "--colour", "blue", "--out", "x", "--names", "a, b", "--count", "4"]
    )

    given = flags.given(args)
    assert given == {
        "mode": "single",
        "colour": "blue",
        "out": Path("x"),
        "names": ("a", "b"),
        "count": 4,
    }
    assert Settings.model_validate(given).colour is Colour.BLUE
    with pytest.raises(SystemExit):
        parser.parse_args(["--colour", "green"])


def test_help_shows_descriptions_and_the_model_defaults() -> None:
    parser, _ = parser_for(include=("round_timeout_s", "deltas"), help={"deltas": "deltas!"})

    text = " ".join(parser.format_help().split())

    assert "--round-timeout-s ROUND_TIMEOUT_S seconds per round (default: 600.0)" in text
    assert "--deltas, --no-deltas deltas! (default: on)" in text
    assert "--mode" not in text


def test_a_field_without_a_flag_form_is_a_type_error() -> None:
    class Odd(BaseModel):
        mapping: dict[str, int] = {}

    with pytest.raises(TypeError, match="--mapping"):
        ModelFlags().add(argparse.ArgumentParser(), Odd)


def test_comma_list_drops_blanks() -> None:
    assert comma_list(" int8, ,int8/int4,") == ("int8", "int8/int4")


def test_a_field_may_have_several_option_strings_and_dests_name_the_fields() -> None:
    parser, flags = parser_for(flags={"deltas": ("-d", "--deltas"), "count": ("-n", "--count")})

    args = parser.parse_args(["-d", "-n", "5", "--rate", "0.2"])

    assert flags.given(args) == {"deltas": True, "count": 5, "inner": {"rate": 0.2}}
    assert flags.given(parser.parse_args(["--no-deltas"])) == {"deltas": False}
    paths = {action.dest: flags.dests.get(action.dest) for action in parser._actions}
    assert paths.pop("help") is None
    expected = [(name,) for name in Settings.model_fields if name != "inner"]
    assert sorted(paths.values()) == sorted([*expected, ("inner", "rate")])
