"""Command-line flags derived from pydantic settings models: defaults live in the model.

:class:`ModelFlags` adds one argparse option per field of a model (``round_timeout_s``
-> ``--round-timeout-s`` unless renamed), with the field's type, its choices (``Literal``
and ``Enum`` fields), its description as the help and the model's default shown in it.
Booleans get ``--flag`` / ``--no-flag``. Nested models (``training``) are flattened into
their own fields' flags. Every option defaults to "not given", and
:meth:`ModelFlags.given` returns only what the user typed, nested as the model is, so a
config file or the model's own defaults fill the rest::

    flags = ModelFlags()
    flags.add(parser, CoordinatorConfig, include=("rounds", "training"))
    args = parser.parse_args(["--rounds", "3", "--lr", "0.1"])
    flags.given(args)  # {"rounds": 3, "training": {"lr": 0.1}}

:func:`add_fleet_flags`, :func:`add_training_flags` and :func:`given_settings` spell the
coordinator's settings the same way for ``python -m coordinator`` and ``python -m sim
run`` / ``budget`` (``--round-timeout``, ``--precision`` for both directions, the
registries' names as choices). Parsing itself stays in those command lines.
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from coordinator.config import FleetSettings, TrainingSettings
from coordinator.strategies.registry import strategy_names
from models import classifier_names
from protocol.tensors import Precision

__all__ = [
    "ModelFlags",
    "add_fleet_flags",
    "add_training_flags",
    "comma_list",
    "given_settings",
]

_DEST = "settings:"


def comma_list(text: str) -> tuple[str, ...]:
    """``"a, b,,c"`` -> ``("a", "b", "c")``: a flag value holding several items."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


class ModelFlags:
    """The flags of one or more pydantic models on one parser, and what the user gave.

    Call :meth:`add` for each model (or part of one, into an argument group) while
    building the parser; after parsing, :meth:`given` returns the values of the flags
    given on the command line as a nested dict of field names.
    """

    def __init__(self) -> None:
        self._paths: dict[str, tuple[str, ...]] = {}

    def add(
        self,
        parser: argparse.ArgumentParser | argparse._ActionsContainer,
        model: type[BaseModel],
        *,
        include: Iterable[str] | None = None,
        exclude: Iterable[str] = (),
        path: Sequence[str] = (),
        flags: Mapping[str, str] | None = None,
        choices: Mapping[str, Sequence[str]] | None = None,
        help: Mapping[str, str] | None = None,
        metavars: Mapping[str, str] | None = None,
    ) -> None:
        """Add a flag for each field of ``model`` (in ``include``'s order when given).

        Args:
            parser: the parser, or an argument group of it, to add the flags to.
            model: the settings model whose fields become flags.
            include: the fields to add (default: all but ``exclude``); a nested model
                field adds all its fields' flags (``path`` + the field's name).
            exclude: fields to leave out.
            path: where ``model`` sits in the settings :meth:`given` builds
                (``("training",)`` for the training fields of a run).
            flags: field name -> option string (``{"round_timeout_s":
                "--round-timeout"}``); default ``--`` + the name with ``-`` for ``_``.
            choices: field name -> allowed values, for fields whose type does not say
                them (a registry of names).
            help: field name -> help text instead of the field's description.
            metavars: field name -> metavar.

        Raises:
            TypeError: a field's type has no flag form (a bug of the caller: exclude it).
        """
        fields = model.model_fields
        names = list(include) if include is not None else list(fields)
        skip = set(exclude)
        for name in names:
            if name in skip:
                continue
            info = fields[name]
            nested = _nested_model(info.annotation)
            if nested is not None:
                self.add(
                    parser,
                    nested,
                    path=(*path, name),
                    flags=flags,
                    choices=choices,
                    help=help,
                    metavars=metavars,
                )
                continue
            # shown in the help only where the model has a plain default
            default = None if info.is_required() or info.default_factory else info.default
            option = (flags or {}).get(name, "--" + name.replace("_", "-"))
            text = (help or {}).get(name, _describe(info))
            self._add_one(
                parser,
                option,
                dest=_DEST + ".".join((*path, name)),
                annotation=info.annotation,
                help_text=text,
                default=default,
                choices=(choices or {}).get(name),
                metavar=(metavars or {}).get(name),
            )
            self._paths[_DEST + ".".join((*path, name))] = (*path, name)

    def _add_one(
        self,
        parser: argparse.ArgumentParser | argparse._ActionsContainer,
        option: str,
        *,
        dest: str,
        annotation: Any,
        help_text: str,
        default: Any,
        choices: Sequence[str] | None,
        metavar: str | None,
    ) -> None:
        kind = _strip_optional(annotation)
        shown = _shown(default)
        text = f"{help_text} (default: {shown})" if shown is not None else help_text
        text = text.replace("%", "%%")
        common: dict[str, Any] = {"dest": dest, "default": None, "help": text}
        if kind is bool:
            parser.add_argument(option, action=argparse.BooleanOptionalAction, **common)
            return
        convert: Callable[[str], Any]
        allowed: list[Any] | None = list(choices) if choices is not None else None
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            convert, allowed = str, [member.value for member in kind]
        elif typing.get_origin(kind) is Literal:
            values = typing.get_args(kind)
            convert, allowed = type(values[0]), list(values)
        elif typing.get_origin(kind) is tuple:
            convert = comma_list
        elif kind in (int, float, str, Path):
            convert = kind
        else:
            raise TypeError(f"{option}: no flag form for a field of type {annotation!r}")
        if metavar is None and allowed is None:
            metavar = option.lstrip("-").replace("-", "_").upper()
        parser.add_argument(option, type=convert, choices=allowed, metavar=metavar, **common)

    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        """The values of the flags given on the command line, nested by field path."""
        out: dict[str, Any] = {}
        for dest, path in self._paths.items():
            value = getattr(args, dest, None)
            if value is None:
                continue
            section = out
            for part in path[:-1]:
                section = section.setdefault(part, {})
            section[path[-1]] = value
        return out


def _describe(info: FieldInfo) -> str:
    """The field's description as a help text: one line, no final period, and lower
    case first unless the first word is a name (FedKF, L2, MQTT)."""
    text = " ".join((info.description or "").split())
    text = text.rstrip(".") if text.count(". ") == 0 else text
    first = text.split(" ", 1)[0]
    if len(first) > 1 and first[1:].isalpha() and first[1:].islower():
        text = text[0].lower() + text[1:]
    return text


def _shown(default: Any) -> str | None:
    if default is None:
        return None
    if isinstance(default, enum.Enum):
        return str(default.value)
    if isinstance(default, bool):
        return "on" if default else "off"
    if isinstance(default, tuple):
        return ",".join(str(item) for item in default) or None
    return str(default)


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _strip_optional(args[0])
    if typing.get_origin(annotation) is typing.Annotated:
        return _strip_optional(typing.get_args(annotation)[0])
    return annotation


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    kind = _strip_optional(annotation)
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return kind
    return None


# -- the flag sets of the coordinator's settings (python -m coordinator, python -m sim)

_TRAINING_ORDER = ("local_epochs", "local_steps", "batch_size")


def add_fleet_flags(
    parser: argparse._ActionsContainer,
    flags: ModelFlags,
    model: type[FleetSettings] = FleetSettings,
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
) -> None:
    """The flags of :class:`FleetSettings` (``model`` or a subclass of it) and
    ``--precision`` (both directions at once), as the coordinator and the sim spell them."""
    names = [n for n in (include or model.model_fields) if n not in exclude]
    split = names.index("downlink_precision") if "downlink_precision" in names else len(names)
    options: dict[str, Any] = {
        "flags": {"round_timeout_s": "--round-timeout"},
        "choices": {"strategy": strategy_names()},
        "metavars": {"model": "MODEL[,MODEL...]"},
        "help": {
            "model": "classifier, or a comma-separated list of them for a fleet that mixes "
            f"architectures (one group each): {', '.join(classifier_names())}"
        },
    }
    flags.add(parser, model, include=names[:split], **options)
    precision = FleetSettings.model_fields["downlink_precision"].default
    parser.add_argument(
        "--precision",
        choices=[x.value for x in Precision],
        help=f"transfer precision both ways (default: {precision.value}); "
        "--downlink-precision and --uplink-precision set one direction",
    )
    flags.add(parser, model, include=names[split:], **options)


def add_training_flags(
    parser: argparse._ActionsContainer, flags: ModelFlags, include: Sequence[str] | None = None
) -> None:
    """The flags of :class:`TrainingSettings` (``--local-epochs``, ``--lr`` ...): the
    settings of ``training``."""
    names = include or (
        *_TRAINING_ORDER,
        *(n for n in TrainingSettings.model_fields if n not in _TRAINING_ORDER),
    )
    flags.add(parser, TrainingSettings, include=names, path=("training",))


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags, nested as the models are, with ``--precision``
    applied to the directions not given on their own.

    ``args`` comes from a parser whose ``settings_flags`` default is the :class:`ModelFlags`
    that added the flags (``parser.set_defaults(settings_flags=flags)``)."""
    flags: ModelFlags = args.settings_flags
    given = flags.given(args)
    if getattr(args, "precision", None) is not None:
        for field in ("downlink_precision", "uplink_precision"):
            given.setdefault(field, args.precision)
    return given
