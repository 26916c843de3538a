"""The run report of the lab emulator: per-round records, JSON, CSV, plots, progress bar.

A :class:`RunReport` holds the run's configuration, one :class:`RoundRecord` per round
and a ``final`` summary. It is written as

- ``report.json`` (:meth:`RunReport.write_json`)::

      {"config": {...},
       "rounds": [{"round", "wall_s", "active_devices", "bytes_up", "bytes_down",
                   "wire_bytes_up", "wire_bytes_down", "device_train_s",
                   "models": {"<name>": {"amp", "fm", "wlp", "global_acc"}}}],
       "final": {...}}

- ``rounds.csv`` (:func:`write_csv`): one row per round, model metrics flattened into
  ``<name>_amp``, ``<name>_fm``, ``<name>_wlp``, ``<name>_global_acc`` columns;
- ``accuracy.png`` and ``bytes.png`` (:func:`write_plots`, needs matplotlib: the
  ``report`` extra).

Every file is written atomically (a temporary file in the same folder, then
``os.replace``); parent folders are created. Byte counts are bytes; "MB" is 10^6 bytes.
Metrics are in percent (FM in percent squared), see :mod:`sim.metrics`.
:class:`ProgressBar` is the CLI's one-line progress display.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, TextIO

import numpy as np

from sim.errors import ReportError
from sim.metrics import ModelMetrics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "ACCURACY_PLOT",
    "BYTES_PLOT",
    "CSV_NAME",
    "ProgressBar",
    "RoundRecord",
    "RunReport",
    "human_bytes",
    "write_csv",
    "write_plots",
]

logger = logging.getLogger(__name__)

CSV_NAME = "rounds.csv"
ACCURACY_PLOT = "accuracy.png"
BYTES_PLOT = "bytes.png"

_ROUND_FIELDS = (
    "round",
    "wall_s",
    "active_devices",
    "bytes_up",
    "bytes_down",
    "wire_bytes_up",
    "wire_bytes_down",
    "device_train_s",
)
_METRIC_FIELDS = ("amp", "fm", "wlp", "global_acc")
_MB = 1e6
_INSTALL_HINT = 'plots need matplotlib: pip install "edgefl[report]"'


@dataclass
class RoundRecord:
    """What one round did and how good its global models are afterwards.

    Attributes:
        round: round number, 1-based.
        wall_s: wall-clock duration of the round, seconds.
        active_devices: devices that trained in the round.
        bytes_up / bytes_down: encoded message payload bytes, devices -> coordinator
            and coordinator -> devices, in this round.
        wire_bytes_up / wire_bytes_down: the same as sent on the wire (MQTT framing,
            chunk headers), bytes.
        device_train_s: mean seconds the round's on-time devices spent in local
            training (as they reported it), or None.
        models: model name (``"aca"``, ``"oca"``) -> its metrics after the round.
    """

    round: int
    wall_s: float
    active_devices: int
    bytes_up: int
    bytes_down: int
    wire_bytes_up: int
    wire_bytes_down: int
    models: dict[str, ModelMetrics] = field(default_factory=dict)
    device_train_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The round as the JSON object described in the module docstring."""
        data: dict[str, Any] = {name: getattr(self, name) for name in _ROUND_FIELDS}
        data["models"] = {name: metrics.to_dict() for name, metrics in self.models.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoundRecord:
        """Inverse of :meth:`to_dict`.

        Raises:
            ReportError: a key is missing or a value has the wrong type.
        """
        try:
            models = {
                name: ModelMetrics(**{key: values[key] for key in _METRIC_FIELDS})
                for name, values in data["models"].items()
            }
            fields = {name: data[name] for name in _ROUND_FIELDS if name != "device_train_s"}
            return cls(**fields, device_train_s=data.get("device_train_s"), models=models)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ReportError(f"malformed round record: {exc!r}") from exc


@dataclass
class RunReport:
    """A whole run: its configuration, the rounds so far and a final summary.

    Attributes:
        config: the run's configuration as JSON-serialisable values.
        rounds: one record per completed round, in order.
        final: summary of the end of the run (JSON-serialisable), e.g. final metrics.
    """

    config: dict[str, Any]
    rounds: list[RoundRecord] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, Any]:
        """``{"config", "rounds", "final"}`` as plain dicts and lists (see module doc)."""
        return {
            "config": dict(self.config),
            "rounds": [record.to_dict() for record in self.rounds],
            "final": dict(self.final),
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> RunReport:
        """Inverse of :meth:`to_json_dict`, e.g. on a loaded ``report.json``.

        Raises:
            ReportError: a key is missing or a value has the wrong type.
        """
        try:
            return cls(
                config=dict(data["config"]),
                rounds=[RoundRecord.from_dict(item) for item in data["rounds"]],
                final=dict(data["final"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ReportError(f"malformed run report: {exc!r}") from exc

    def write_json(self, path: str | os.PathLike[str]) -> Path:
        """Write the report as indented JSON to ``path``, atomically; returns the path.

        Raises:
            ReportError: a value is not JSON-serialisable (NaN and infinity included),
                or an OS error occurred (the message names the file).
        """
        target = Path(path)
        try:
            text = json.dumps(self.to_json_dict(), indent=2, allow_nan=False) + "\n"
        except (TypeError, ValueError) as exc:
            raise ReportError(f"cannot write {target}: report is not JSON: {exc}") from exc
        _atomic_write(target, lambda handle: handle.write(text.encode("utf-8")))
        logger.debug("wrote %s (%d rounds)", target, len(self.rounds))
        return target


def _atomic_write(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write through ``write`` into a temporary sibling of ``path``, then replace ``path``.

    Raises:
        ReportError: on any OS error; the temporary file is removed.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                write(handle)
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except OSError as exc:
        raise ReportError(f"cannot write {path}: {exc}") from exc


def _model_names(report: RunReport) -> list[str]:
    """Model names in order of first appearance over the rounds."""
    names: dict[str, None] = {}
    for record in report.rounds:
        names.update(dict.fromkeys(record.models))
    return list(names)


def write_csv(report: RunReport, out_dir: str | os.PathLike[str]) -> Path:
    """Write ``rounds.csv`` into ``out_dir``, atomically; returns its path.

    Columns: the round fields (``round``, ``wall_s``, ``active_devices``, ``bytes_up``,
    ``bytes_down``, ``wire_bytes_up``, ``wire_bytes_down``, ``device_train_s``), then
    for each model (in order of first appearance) ``<name>_amp``, ``<name>_fm``,
    ``<name>_wlp``, ``<name>_global_acc``. A metric that is absent (model missing in a
    round, no global test set) is an empty cell.

    Raises:
        ReportError: an OS error occurred while writing.
    """
    names = _model_names(report)
    header = [*_ROUND_FIELDS, *(f"{name}_{key}" for name in names for key in _METRIC_FIELDS)]
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(header)
    for record in report.rounds:
        row: list[object] = [
            "" if getattr(record, key) is None else getattr(record, key) for key in _ROUND_FIELDS
        ]
        for name in names:
            metrics = record.models.get(name)
            values = metrics.to_dict() if metrics is not None else {}
            row.extend("" if values.get(key) is None else values[key] for key in _METRIC_FIELDS)
        writer.writerow(row)
    target = Path(out_dir) / CSV_NAME
    _atomic_write(target, lambda handle: handle.write(buffer.getvalue().encode("utf-8")))
    logger.debug("wrote %s", target)
    return target


def _new_figure() -> Figure:
    """A figure on the Agg canvas (no pyplot, no global backend switch) with one axes.

    Raises:
        ReportError: matplotlib is not installed.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ReportError(_INSTALL_HINT) from exc
    figure = Figure(figsize=(7.0, 4.0), dpi=100, layout="tight")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    axes.set_xlabel("round")
    axes.grid(alpha=0.3)
    return figure


def _save_figure(figure: Figure, path: Path) -> None:
    _atomic_write(path, lambda handle: figure.savefig(handle, format="png"))


def write_plots(report: RunReport, out_dir: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write ``accuracy.png`` and ``bytes.png`` into ``out_dir``; returns their paths.

    ``accuracy.png``: AMP (percent) per round for each model, solid, and its global test
    accuracy, dashed, where there is one. ``bytes.png``: cumulative payload and wire
    bytes, up and down, in MB (10^6 bytes) per round. A report without rounds gives
    empty axes.

    Raises:
        ReportError: matplotlib is missing (install the ``report`` extra), or an OS
            error occurred while writing.
    """
    out = Path(out_dir)
    accuracy = _new_figure()
    axes = accuracy.axes[0]
    for index, name in enumerate(_model_names(report)):
        color = f"C{index}"
        rounds = [r for r in report.rounds if name in r.models]
        x = [r.round for r in rounds]
        amps = [r.models[name].amp for r in rounds]
        axes.plot(x, amps, color=color, marker="o", markersize=3, label=f"{name} AMP")
        with_global = [
            (r.round, acc) for r in rounds if (acc := r.models[name].global_acc) is not None
        ]
        if with_global:
            axes.plot(
                [round_ for round_, _ in with_global],
                [acc for _, acc in with_global],
                color=color,
                linestyle="--",
                label=f"{name} global",
            )
    axes.set_ylabel("accuracy (%)")
    axes.set_title("AMP over device test splits (solid), global test accuracy (dashed)")
    if axes.get_lines():
        axes.legend()
    accuracy_path = out / ACCURACY_PLOT
    _save_figure(accuracy, accuracy_path)

    traffic = _new_figure()
    axes = traffic.axes[0]
    x = [r.round for r in report.rounds]
    series = (
        ("payload up", "bytes_up", "-"),
        ("payload down", "bytes_down", "-"),
        ("wire up", "wire_bytes_up", ":"),
        ("wire down", "wire_bytes_down", ":"),
    )
    for index, (label, key, style) in enumerate(series):
        totals = np.cumsum([getattr(r, key) for r in report.rounds], dtype=np.float64) / _MB
        axes.plot(x, totals, color=f"C{index % 2}", linestyle=style, label=label)
    axes.set_ylabel("cumulative MB (10^6 bytes)")
    axes.set_title("Traffic so far")
    if report.rounds:
        axes.legend()
    bytes_path = out / BYTES_PLOT
    _save_figure(traffic, bytes_path)
    logger.debug("wrote %s and %s", accuracy_path, bytes_path)
    return accuracy_path, bytes_path


_UNITS = ("kB", "MB", "GB", "TB", "PB")


def human_bytes(n: int) -> str:
    """``n`` bytes in decimal units: ``"532 B"``, ``"1.5 kB"``, ``"12.3 MB"``, ``"2.0 GB"``.

    Raises:
        ValueError: ``n`` is negative.
    """
    if n < 0:
        raise ValueError(f"byte count must be >= 0, got {n}")
    if n < 1000:
        return f"{n} B"
    value = float(n)
    for index, unit in enumerate(_UNITS):
        value /= 1000.0
        if round(value, 1) < 1000.0 or index == len(_UNITS) - 1:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")  # the loop returns on its last unit


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class ProgressBar:
    """Round progress for the CLI: one redrawn line on a terminal, one line per round else.

    On a TTY each :meth:`update` redraws the line with ``\\r``, e.g.::

        [##########..........] round 5/10 | AMP aca 81.2% oca 80.9% | up 1.2 MB down
        3.4 MB | 2.31 s/round

    (one line on screen; wrapped here).

    Elsewhere (a file, a pipe, CI logs) it writes the same text without the bar, one
    line per round. Seconds per round are the mean over the rounds reported so far.
    Usable as a context manager (``close`` on exit).
    """

    width = 20
    """Characters between the brackets of the bar."""

    def __init__(self, total_rounds: int, stream: TextIO | None = None) -> None:
        """Args:
            total_rounds: rounds the run will do (>= 1).
            stream: where to write; ``sys.stderr`` (looked up now) when None.

        Raises:
            ValueError: ``total_rounds`` < 1.
        """
        if total_rounds < 1:
            raise ValueError(f"total_rounds must be >= 1, got {total_rounds}")
        self._total = total_rounds
        self._stream = stream if stream is not None else sys.stderr
        self._tty = _isatty(self._stream)
        self._updates = 0
        self._wall_s = 0.0
        self._drawn = 0  # length of the line on screen (TTY)

    def _text(self, record: RoundRecord, cumulative_up: int, cumulative_down: int) -> str:
        parts = [f"round {record.round}/{self._total}"]
        if record.models:
            amps = " ".join(f"{name} {m.amp:.1f}%" for name, m in record.models.items())
            parts.append(f"AMP {amps}")
        parts.append(f"up {human_bytes(cumulative_up)} down {human_bytes(cumulative_down)}")
        parts.append(f"{self._wall_s / self._updates:.2f} s/round")
        return " | ".join(parts)

    def update(self, record: RoundRecord, cumulative_up: int, cumulative_down: int) -> None:
        """Show ``record``; ``cumulative_up`` / ``cumulative_down``: bytes sent so far."""
        self._updates += 1
        self._wall_s += record.wall_s
        text = self._text(record, cumulative_up, cumulative_down)
        if self._tty:
            filled = round(self.width * min(max(record.round, 0), self._total) / self._total)
            line = f"[{'#' * filled}{'.' * (self.width - filled)}] {text}"
            self._stream.write("\r" + line + " " * max(0, self._drawn - len(line)))
            self._drawn = len(line)
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def close(self) -> None:
        """End the redrawn line on a TTY (idempotent); nothing otherwise."""
        if self._tty and self._drawn:
            self._stream.write("\n")
            self._stream.flush()
        self._drawn = 0

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
