"""The run report: per-round records, JSON, CSV and plots (docs/report.md).

Both the lab emulator (``python -m sim --json-out/--report-dir``) and the coordinator
(``python -m coordinator --json-out/--report-dir``, :mod:`coordinator.recording`) write
it.

A :class:`RunReport` holds the run's configuration, one :class:`RoundRecord` per round
and a ``final`` summary. It is written as

- ``report.json`` (:meth:`RunReport.write_json`)::

      {"config": {...},
       "rounds": [{"round", "wall_s", "active_devices", "bytes_up", "bytes_down",
                   "wire_bytes_up", "wire_bytes_down", "device_train_s", "aggregate_s",
                   "closed_s", "models": {"<name>": {"amp", "fm", "wlp", "best", "global_acc"}},
                   "server_metrics": {"<name>": float}}],
       "final": {...}}

- ``rounds.csv`` (:func:`write_csv`): one row per round, model metrics flattened into
  ``<name>_amp``, ``<name>_fm``, ``<name>_wlp``, ``<name>_best``, ``<name>_global_acc``
  columns;
- ``accuracy.png`` and ``bytes.png`` (:func:`write_plots`, needs matplotlib: the
  ``report`` extra).

Every file is written atomically (a temporary file in the same folder, then
``os.replace``); parent folders are created. Byte counts are bytes; "MB" is 10^6 bytes.
Metrics are in percent (FM in percent squared), see :mod:`coordinator.evaluation`.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from coordinator.errors import CoordinatorError
from coordinator.evaluation import ModelMetrics

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "ACCURACY_PLOT",
    "BYTES_PLOT",
    "CSV_NAME",
    "ReportError",
    "RoundRecord",
    "RunReport",
    "accuracy_figure",
    "human_bytes",
    "run_label",
    "traffic_figure",
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
    "aggregate_s",
    "closed_s",
)
_OPTIONAL_FIELDS = {"device_train_s": None, "aggregate_s": 0.0, "closed_s": None}
"""Round fields that reports of earlier versions lack, with the value they stand for."""
_METRIC_FIELDS = ("amp", "fm", "wlp", "best", "global_acc")
_MB = 1e6
_INSTALL_HINT = 'plots need matplotlib: pip install "edgefl[report]"'


class ReportError(CoordinatorError):
    """A run report (JSON, CSV or plots) cannot be written, or read back.

    Raised when matplotlib is missing for plots (the message says how to install it),
    when the report holds values JSON cannot represent, for malformed data given to
    :meth:`RunReport.from_json_dict`, and for OS errors while writing (the message names
    the file; the OS error is the ``__cause__``).
    """


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
        aggregate_s: seconds the coordinator's server step took (FedDF's distillation,
            FedGen's or DENSE's generator; a weighted sum for FedAvg).
        closed_s: seconds from the coordinator's start to the round's close (the
            evaluation comes after, off the rounds' path), or None.
        models: model name (``"aca"``, ``"oca"``) -> its metrics after the round.
        server_metrics: what the round's server step measured, by name (oneshot: the
            ensemble's and each student's held-out accuracy); empty for most strategies,
            absent from reports of before the field.
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
    aggregate_s: float = 0.0
    closed_s: float | None = None
    server_metrics: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The round as the JSON object described in the module docstring."""
        data: dict[str, Any] = {name: getattr(self, name) for name in _ROUND_FIELDS}
        data["models"] = {name: metrics.to_dict() for name, metrics in self.models.items()}
        data["server_metrics"] = dict(self.server_metrics)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RoundRecord:
        """Inverse of :meth:`to_dict`.

        Raises:
            ReportError: a key is missing or a value has the wrong type.
        """
        try:
            models = {
                name: ModelMetrics(
                    **{key: values[key] for key in _METRIC_FIELDS if key != "best"},
                    best=values.get("best"),
                )
                for name, values in data["models"].items()
            }
            fields: dict[str, Any] = {
                name: data.get(name, _OPTIONAL_FIELDS[name])
                if name in _OPTIONAL_FIELDS
                else data[name]
                for name in _ROUND_FIELDS
            }
            server = {str(k): float(v) for k, v in data.get("server_metrics", {}).items()}
            return cls(**fields, models=models, server_metrics=server)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
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
    ``bytes_down``, ``wire_bytes_up``, ``wire_bytes_down``, ``device_train_s``,
    ``aggregate_s``), then
    for each model (in order of first appearance) ``<name>_amp``, ``<name>_fm``,
    ``<name>_wlp``, ``<name>_best``, ``<name>_global_acc``. A metric that is absent
    (model missing in a round, no global test set) is an empty cell.

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

    ``accuracy.png``: per round and model, AMP (percent, solid line) with the spread of
    the per-device accuracies shaded (from the worst device, WLP, to the best), the
    global test accuracy (dashed) where there is one, and chance level (dotted, 100 /
    ``final["num_classes"]`` percent) where the report has the class count. ``bytes.png``: what each
    round cost, payload bytes up and down per round in MB (10^6 bytes), as bars side
    by side; the wire bytes (MQTT framing included) as markers over them. Each names
    its run above (:func:`run_label`) and keeps its legend under the axes. A report
    without rounds gives empty axes.

    Raises:
        ReportError: matplotlib is missing (install the ``report`` extra), or an OS
            error occurred while writing.
    """
    out = Path(out_dir)
    accuracy_path, bytes_path = out / ACCURACY_PLOT, out / BYTES_PLOT
    _save_figure(accuracy_figure(report), accuracy_path)
    _save_figure(traffic_figure(report), bytes_path)
    logger.debug("wrote %s and %s", accuracy_path, bytes_path)
    return accuracy_path, bytes_path


def accuracy_figure(report: RunReport) -> Figure:
    """The figure of ``accuracy.png`` (see :func:`write_plots`).

    Raises:
        ReportError: matplotlib is missing.
    """
    accuracy = _new_figure()
    axes = accuracy.axes[0]
    for index, name in enumerate(_model_names(report)):
        color = f"C{index}"
        rounds = [r for r in report.rounds if name in r.models]
        x = [r.round for r in rounds]
        amps = [r.models[name].amp for r in rounds]
        axes.plot(x, amps, color=color, marker="o", markersize=3, label=f"{name} AMP")
        spread = [
            (r.round, m.wlp, m.best) for r in rounds if (m := r.models[name]).best is not None
        ]
        if spread:
            axes.fill_between(
                [round_ for round_, _, _ in spread],
                [low for _, low, _ in spread],
                [high for _, _, high in spread],
                color=color,
                alpha=0.15,
                linewidth=0,
                label=f"{name} devices (worst to best)",
            )
        with_global = [
            (r.round, acc) for r in rounds if (acc := r.models[name].global_acc) is not None
        ]
        if with_global:
            axes.plot(
                [round_ for round_, _ in with_global],
                [acc for _, acc in with_global],
                color=color,
                linestyle="--",
                label=f"{name} global test",
            )
    num_classes = report.final.get("num_classes")
    if isinstance(num_classes, int) and num_classes > 0:
        axes.axhline(100.0 / num_classes, color="grey", linestyle=":", label="chance")
    axes.set_ylabel("accuracy (%)")
    axes.set_ylim(0, 100)
    axes.set_title("Accuracy after each round (AMP over the devices' test splits)")
    accuracy.suptitle(run_label(report), fontsize="small")
    if axes.get_lines():
        _legend_below(axes)
    return accuracy


def traffic_figure(report: RunReport) -> Figure:
    """The figure of ``bytes.png`` (see :func:`write_plots`).

    Raises:
        ReportError: matplotlib is missing.
    """
    traffic = _new_figure()
    axes = traffic.axes[0]
    x = np.array([r.round for r in report.rounds], dtype=np.float64)
    width = 0.4
    for index, (label, key, wire_key, offset) in enumerate(
        (
            ("up (devices to coordinator)", "bytes_up", "wire_bytes_up", -width / 2),
            ("down (coordinator to devices)", "bytes_down", "wire_bytes_down", width / 2),
        )
    ):
        payload = np.array([getattr(r, key) for r in report.rounds], dtype=np.float64) / _MB
        wire = np.array([getattr(r, wire_key) for r in report.rounds], dtype=np.float64) / _MB
        color = f"C{index}"
        axes.bar(x + offset, payload, width=width, color=color, label=f"{label}, payload")
        axes.plot(
            x + offset,
            wire,
            linestyle="none",
            marker="_",
            markersize=12,
            color="k",
            label="wire (MQTT framing included)" if index == 0 else None,
        )
    axes.set_ylabel("MB per round (10^6 bytes)")
    axes.set_title("What each round cost on the wire")
    traffic.suptitle(run_label(report), fontsize="small")
    if report.rounds:
        _legend_below(axes)
    return traffic


def _legend_below(axes: Axes) -> None:
    """The legend under the axes, never over the bars or lines it explains."""
    axes.legend(
        fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False
    )


def run_label(report: RunReport) -> str:
    """Which run a plot is of, from its configuration: strategy, model, data, fleet
    size and precisions as far as the report has them (``fedavg on lenet5, mnist
    (alpha=0.5), 50 devices, fp32 down / int8 up, 10 rounds``)."""
    config = report.config
    parts = [f"{config.get('strategy', '?')} on {config.get('model', '?')}"]
    if "dataset" in config:
        alpha = config.get("alpha")
        parts.append(f"{config['dataset']}" + (f" (alpha={alpha})" if alpha is not None else ""))
    if "devices" in config:
        parts.append(f"{config['devices']} devices")
    elif "fleet" in config:
        parts.append(f"fleet {config['fleet']}")
    down, up = config.get("downlink_precision"), config.get("uplink_precision")
    if down is not None and up is not None:
        parts.append(f"{down}" if down == up else f"{down} down / {up} up")
    parts.append(f"{len(report.rounds)} rounds")
    return ", ".join(parts)


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
