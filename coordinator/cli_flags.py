"""The coordinator's settings as flags, spelled the same way for ``python -m coordinator``
and ``python -m sim run`` / ``budget``.

:func:`add_fleet_flags`, :func:`add_training_flags` and :func:`given_settings` add the
flags of :class:`~coordinator.config.FleetSettings` and
:class:`~coordinator.config.TrainingSettings` with the generic builder
:class:`protocol.flags.ModelFlags` (``--round-timeout``, ``--precision`` for both
directions, the registries' names as choices). Parsing itself stays in those command
lines.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from coordinator.config import FleetSettings, TrainingSettings
from coordinator.strategies.registry import strategy_names
from models import classifier_names
from protocol.flags import ModelFlags
from protocol.tensors import Precision

__all__ = ["add_fleet_flags", "add_training_flags", "given_settings"]

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
        "flags": {"round_timeout_s": "--round-timeout", "silent_grace_s": "--silent-grace"},
        "choices": {"strategy": strategy_names()},
        "metavars": {"model": "MODEL[,MODEL...]"},
        "help": {
            "model": "classifier, or a comma-separated list of them for a fleet that mixes "
            f"architectures (one group each): {', '.join(classifier_names())}, or a "
            "factory's import path package.module:factory (docs/models.md)"
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
