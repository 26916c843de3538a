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

Both command lines use it: the coordinator's (``python -m coordinator``, ``python -m
sim``) and the edge client's (``python -m edge_client run`` / ``follow``), so it lives
here, where both may import it. Parsing itself stays in those command lines. Imports no
torch.
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

__all__ = ["ModelFlags", "comma_list"]

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
        flags: Mapping[str, str | tuple[str, ...]] | None = None,
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
                "--round-timeout"}``), or several (``("-v", "--verbose")``); default
                ``--`` + the name with ``-`` for ``_``.
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
            options = (option,) if isinstance(option, str) else option
            text = (help or {}).get(name, _describe(info))
            self._add_one(
                parser,
                options,
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
        options: tuple[str, ...],
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
        option = options[-1]
        if kind is bool:
            parser.add_argument(*options, action=argparse.BooleanOptionalAction, **common)
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
        parser.add_argument(*options, type=convert, choices=allowed, metavar=metavar, **common)

    @property
    def dests(self) -> dict[str, tuple[str, ...]]:
        """Each flag's argparse ``dest`` -> the field path it sets (a copy)."""
        return dict(self._paths)

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
