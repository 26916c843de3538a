"""Typed configuration of the coordinator, from flags or a TOML file.

:class:`CoordinatorConfig` holds every setting of a run; ``python -m coordinator`` builds
it from ``--config FILE.toml`` (the same keys, nested ``[training]`` and ``[broker]``
tables) overridden by explicit flags. Constructors take these objects, never argparse
namespaces.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from coordinator.errors import ConfigError
from coordinator.strategies.dense_settings import DenseOptions
from coordinator.strategies.feddf_settings import FedDFOptions
from coordinator.strategies.fedkf_settings import FedKFOptions
from coordinator.strategies.oneshot_settings import OneShotOptions
from coordinator.strategies.options import StrategyOptions
from models import classifier_problem
from protocol.hyperparams import LocalTraining
from protocol.messages import ID_PATTERN, WeightFormat
from protocol.tensors import Precision
from protocol.transport import MqttConfig, MqttVersion, TlsConfig, read_password

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

__all__ = [
    "BrokerSettings",
    "CoordinatorConfig",
    "FleetSettings",
    "MonitorSettings",
    "ServerDevice",
    "TrainingSettings",
    "load_config",
    "parse_address",
    "participants",
    "run_weight_format",
    "settings_problems",
]

Identifier = Annotated[str, Field(pattern=ID_PATTERN)]
ServerDevice = Literal["auto", "cpu", "cuda"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)


class TrainingSettings(LocalTraining):
    """What each selected device is asked to do per round (sent in the task).

    The settings shared with the task (``lr``, ``momentum``, ``mu``, ``gamma`` ...) and
    their defaults are :class:`protocol.hyperparams.LocalTraining`'s, the schema the
    devices validate their tasks with. ``local_epochs``, ``local_steps`` and
    ``batch_size`` left unset (None) take the strategy's defaults
    (:attr:`coordinator.strategies.base.Strategy.training_defaults`: E = 5, B = 32 for FedAvg;
    E = 10, B = 64 and 16 generated samples per step for FedKF; 20 steps of B = 32 for
    FedGen).
    """

    model_config = ConfigDict(strict=False)

    local_epochs: int | None = Field(default=None, ge=0)
    """Local epochs: passes over the local data (unset: the strategy's default)."""
    local_steps: int | None = Field(default=None, ge=0)
    """If > 0: this many local mini-batches instead of epochs."""
    batch_size: int | None = Field(default=None, ge=1)
    """Local batch size (unset: the strategy's default)."""
    generator_batch_size: int | None = Field(default=None, ge=0)
    """FedKF and FedGen: generated samples per generator step and per distillation (or
    generative) step; 0: ``batch_size``, as the papers; unset: the strategy's default
    (FedKF 16, FedGen 0)."""
    generative_alpha: float = Field(default=10.0, ge=0, allow_inf_nan=False)
    """FedGen: weight of the generator term in round 1; round t sends alpha_t =
    generative_alpha * generative_alpha_decay ** (t - 1)."""
    generative_alpha_decay: float = Field(default=0.98, gt=0, le=1)
    """FedGen: per-round decay of generative_alpha."""

    @model_validator(mode="after")
    def _some_training(self) -> TrainingSettings:
        if self.local_epochs == 0 and self.local_steps in (0, None):
            raise ValueError("local_epochs and local_steps cannot both be 0")
        return self

    def with_defaults(self, defaults: Mapping[str, int]) -> TrainingSettings:
        """These settings with the unset (None) ones filled from ``defaults``.

        Epochs and steps go together: when neither is set both come from ``defaults``;
        when one is set the other is 0 (the set one decides). ``batch_size`` falls back
        to ``defaults["batch_size"]`` (32 when absent), ``generator_batch_size`` to
        ``defaults["generator_batch_size"]`` (0 when absent).
        """
        epochs, steps = self.local_epochs, self.local_steps
        if epochs is None and steps is None:
            epochs, steps = defaults.get("local_epochs", 0), defaults.get("local_steps", 0)
        epochs, steps = epochs or 0, steps or 0
        batch = self.batch_size if self.batch_size is not None else defaults.get("batch_size", 32)
        return self.model_copy(
            update={
                "local_epochs": epochs or int(steps == 0),
                "local_steps": steps,
                "batch_size": batch,
                "generator_batch_size": self.generator_batch_size
                if self.generator_batch_size is not None
                else defaults.get("generator_batch_size", 0),
            }
        )


class BrokerSettings(_Frozen):
    """How the coordinator reaches its MQTT broker."""

    url: str | None = None
    """The broker: mqtt://host:port or mqtts://host:port (unset with the embedded one)."""
    embedded: bool = False
    """Start an in-process MQTT broker (amqtt) on embedded_port (lab use)."""
    embedded_port: int = Field(default=1883, ge=0, le=65_535)
    """Port of the embedded broker."""
    username: str | None = None
    """MQTT user name."""
    password: SecretStr | None = None
    """MQTT password (prefer password_file or $EDGEFL_MQTT_PASSWORD)."""
    password_file: Path | None = None
    """File holding the MQTT password."""
    tls_ca: Path | None = None
    """CA bundle; setting any tls_* (or mqtts://) enables TLS."""
    tls_cert: Path | None = None
    """Client certificate."""
    tls_key: Path | None = None
    """The client certificate's key."""
    tls_insecure: bool = False
    """Skip the host name check (test setups only)."""
    mqtt_version: MqttVersion = MqttVersion.V311
    """MQTT protocol version."""
    client_id: str | None = None
    """MQTT client id (default: edgefl-coordinator-FLEET)."""

    @model_validator(mode="after")
    def _one_broker(self) -> BrokerSettings:
        if self.embedded == (self.url is not None):
            raise ValueError("give exactly one of a broker URL and the embedded broker")
        return self

    def mqtt_config(self, url: str, default_client_id: str) -> MqttConfig:
        """The transport configuration for ``url`` with these credentials and TLS options.

        Raises:
            ConfigError: the password file cannot be read, or the URL is invalid.
        """
        password = self.password
        if self.password_file is not None or password is None:
            try:
                password = read_password(self.password_file)
            except OSError as exc:
                raise ConfigError(f"cannot read password file {self.password_file}: {exc}") from exc
        overrides: dict[str, Any] = {
            "client_id": self.client_id or default_client_id,
            "version": self.mqtt_version,
            "username": self.username,
            "password": password,
        }
        if self.tls_ca or self.tls_cert or self.tls_key or self.tls_insecure:
            overrides["tls"] = TlsConfig(
                ca_file=self.tls_ca,
                cert_file=self.tls_cert,
                key_file=self.tls_key,
                insecure=self.tls_insecure,
            )
        try:
            return MqttConfig.from_url(url, **overrides)
        except (ValueError, ValidationError) as exc:
            raise ConfigError(f"invalid broker settings: {exc}") from exc


class _SharedFleetSettings(_Frozen):
    """The fleet settings every strategy reads (see :class:`FleetSettings`)."""

    strategy: str = "fedavg"
    """Federated algorithm (a strategy registry name; the README's table says what each
    does; dense is one-shot: one round in which every device uploads once)."""
    final_model: Literal["aca", "oca"] | None = None
    """The model the run delivers (unset: oca where the strategy keeps one, else aca)."""
    sharing: Literal["full", "head"] = "full"
    """fedavg / fedgen: devices share the whole model or only the prediction head."""
    downlink_precision: Precision = Precision.FP32
    """Precision of the models sent to devices (a device's hello may ask another)."""
    uplink_precision: Precision = Precision.FP32
    """Precision of the updates; lossy ones travel as deltas with error feedback."""
    downlink_deltas: bool = True
    """Lossy downlinks: send a delta against the model a device holds (off: always
    full models)."""
    model: str = "lenet5"
    """Classifier (a model registry name), or a comma-separated list of them for a
    fleet that mixes architectures: one architecture group each (the sim assigns them
    to its devices in turn; a real device names its own in its hello)."""
    rounds: int = Field(default=10, ge=1)
    """Federated rounds to run (left out: the strategy's own default where it has one,
    such as the one-shot dense's 1)."""
    participation: float = Field(default=0.2, gt=0, le=1)
    """Fraction C of the registered devices selected per round (left out: the
    strategy's own default where it has one, such as dense's 1.0)."""
    round_timeout_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    """Seconds devices have per round to deliver their update."""
    silent_grace_s: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    """Once every selected device the coordinator heard from in a round has answered, the
    selected ones it heard nothing from since the round started (a device that stopped
    answering) are dropped after this many seconds and the round closes, without waiting
    for its deadline; 0: the round waits for them to its deadline."""
    max_update_norm_ratio: float = Field(default=10.0, ge=0, allow_inf_nan=False)
    """Norm screening: reject an update whose distance (L2) from the model the device
    was sent exceeds this many times the round's reference (the median of the round's
    accepted ones, at least the previous round's; coordinator/screening.py); 0: off."""
    max_update_norm: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Norm screening: reject an update whose distance (L2) from the model the device
    was sent exceeds this, whatever the round (unset: no absolute cap)."""
    aggregation: Literal["mean", "median", "trimmed_mean"] = "mean"
    """How a group's updates are averaged (fedavg, fedprox, fedavg_oca, fedkf and
    fedgen's ACA): sample-weighted mean, or, against poisoned devices, the unweighted
    coordinate-wise median or trimmed mean (these hold every update of the round in
    memory)."""
    trim_fraction: float = Field(default=0.2, ge=0, lt=0.5)
    """trimmed_mean: the share of the updates cut from each end, coordinate by
    coordinate, before averaging the rest."""
    seed: int = Field(default=0, ge=0)
    """Seed of the model's initialization, device selection and the device seeds."""
    training: TrainingSettings = TrainingSettings()
    """What each selected device is asked to do per round (sent in the task)."""


class FleetSettings(OneShotOptions, DenseOptions, FedDFOptions, FedKFOptions, _SharedFleetSettings):
    """How a federated run trains its fleet: the settings ``python -m coordinator`` and
    the lab emulator (``sim.run.SimConfig``) share, with their one set of defaults.

    The fields every strategy reads are declared in :class:`_SharedFleetSettings`;
    those one strategy reads are declared beside it, as its
    :class:`~coordinator.strategies.options.StrategyOptions`, and mixed in here, flat,
    as the TOML keys and flags spell them: FedKF's ``downlink`` and ``teacher_budget``,
    FedDF's ``drop_worst`` and ``distill_*``, DENSE's ``dense_*``.
    """

    @model_validator(mode="before")
    @classmethod
    def _strategy_defaults(cls, data: Any) -> Any:
        """Settings left out take the strategy's own defaults where it has some
        (:attr:`~coordinator.strategies.options.StrategyOptions.fleet_defaults` of its
        options: dense is one-shot, so a run of it is one round of every device unless
        told otherwise). Given settings win, so an explicit ``rounds`` reaches the
        strategy, which may refuse it."""
        if not isinstance(data, Mapping):
            return data
        strategy = data.get("strategy", cls.model_fields["strategy"].default)
        for options in cls.__mro__:
            if (
                issubclass(options, StrategyOptions)
                and options is not StrategyOptions
                and options.strategy_name == strategy
            ):
                return {**options.fleet_defaults, **data}
        return data

    @field_validator("model")
    @classmethod
    def _known_models(cls, value: str) -> str:
        names = [name.strip() for name in value.split(",")]
        for name in names:  # a registered name, or a user's factory that imports
            if (problem := classifier_problem(name)) is not None:
                raise ValueError(problem)
        if len(set(names)) != len(names):
            raise ValueError(f"{value!r} names an architecture twice")
        return ",".join(names)

    @property
    def architectures(self) -> tuple[str, ...]:
        """The fleet's architectures (registry names), in the order ``model`` lists them."""
        return tuple(self.model.split(","))


class MonitorSettings(_Frozen):
    """Where an operator watches the run (the coordinator's and the sim's flags); never
    part of the run's fingerprint. Addresses are ``[HOST:]PORT``, on 127.0.0.1 unless a
    host is given (port 0: a free one, logged at start)."""

    metrics_port: str | None = None
    """Serve Prometheus metrics at http://[HOST:]PORT/metrics (docs/metrics.md)."""
    dashboard: str | None = None
    """Serve the live web dashboard at http://[HOST:]PORT/ (docs/dashboard.md): read-only;
    a host other than loopback needs dashboard_token_file."""
    dashboard_token_file: Path | None = None
    """Bearer token of the dashboard (one line, 16 characters at least, mode 0600): every
    request must carry it. Required where the dashboard listens beyond loopback."""

    @field_validator("metrics_port", "dashboard")
    @classmethod
    def _an_address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_address(value)
        return value


def parse_address(text: str) -> tuple[str, int]:
    """``[HOST:]PORT`` (``[::1]:PORT`` for an IPv6 host) as (host, port); the host is
    127.0.0.1 when left out.

    Raises:
        ValueError: not of that form, or a port outside 0-65535.
    """
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{text!r} is not [HOST:]PORT (a port from 0 to 65535)")
    return host, int(port)


class CoordinatorConfig(MonitorSettings, FleetSettings):
    """Everything one federated run needs; see ``python -m coordinator --help``."""

    fleet: Identifier = "default"
    """Fleet name: the topic tree fl/FLEET/."""
    coordinator_id: Identifier = "coordinator"
    """Sender id of the coordinator's messages."""
    num_classes: int = Field(default=10, ge=2)
    """Classes of the model."""
    in_channels: int = Field(default=1, ge=1)
    """Input channels of the model."""
    image_size: int = Field(default=28, ge=8)
    """Input side of the model, in pixels."""
    input_shape: tuple[int, ...] | None = Field(default=None, min_length=1, max_length=8)
    """Shape of one input sample when the samples are not images (a model of the user's
    on series or feature vectors, docs/models.md); unset: in_channels x image_size x
    image_size."""
    min_devices: int = Field(default=1, ge=1)
    """Online devices needed to start a round."""
    connect_retry_s: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    """Keep retrying the first connection to the broker this long, seconds (a service
    started beside its broker may come up first); 0: one attempt."""
    state_dir: Path | None = None
    """Folder of the persistent state and final models (unset: in memory, no resume)."""
    resume: bool = False
    """Continue the run persisted in state_dir (a missing or empty one starts a fresh run)."""
    export_onnx: bool = True
    """Also save the final models as .onnx next to the .pt."""
    json_out: Path | None = None
    """Write the run report here as JSON (docs/report.md) when the run ends (stopped: the
    rounds it finished); checked before the run starts"""
    report_dir: Path | None = None
    """Write the report's rounds.csv here when the run ends, and accuracy.png and bytes.png
    where matplotlib is installed (the report extra); checked before the run starts"""
    eval_data: Path | None = None
    """Evaluate every round's global models on this held-out data, off the rounds' path:
    an .npz with x, (N, C, H, W) or (N, H, W) images, uint8 or floats in [0, 1], and y,
    integer labels (a device file of python -m sim partition is one); its accuracy is the
    report's global_acc, amp and wlp (docs/report.md)"""
    proxy_data: Path | None = None
    """Unlabeled images for server-side distillation (feddf with distill_data proxy; every
    other strategy refuses them): a .npy file of (N, C, H, W) or (N, H, W) images, uint8
    or floats in [0, 1], or a folder holding a dataset's official train files (MNIST,
    Fashion-MNIST, EMNIST letters, CIFAR-10; labels never read), itself or in the
    dataset's usual subfolder, as data_dir. No device data reaches the server."""
    proxy_size: int | None = Field(default=None, ge=2)
    """Proxy images to use, drawn at random (seeded by the run's seed) from proxy_data
    (unset: all of them)."""
    server_device: ServerDevice = "auto"
    """Where server-side training (FedGen's generator, FedDF's and DENSE's distillation)
    runs: auto (a GPU where torch sees one, else the CPU), cpu or cuda."""
    broadcast_model: bool = False
    """After each round publish the final model on fl/FLEET/broadcast/model for devices
    that serve it (python -m edge_client follow / --serve-onnx)."""
    device_keys: Path | None = None
    """Keyring of the fleet (JSON: device id -> 64 hex digits, mode 0600): the devices
    allowed to join; every message is authenticated with its device's key
    (docs/protocol.md, section 2.3). Required unless fleet_token_file, devices enrolled
    in state_dir, or insecure_no_auth."""
    fleet_token_file: Path | None = None
    """Fleet token (64 hex digits, mode 0600; python -m protocol keys --new-fleet-token):
    a device not in device_keys whose frames verify under the key derived from the token
    for its id is enrolled, its key kept in STATE_DIR/enrolled-keys.json* (docs/protocol.md,
    section 2.4). Whoever holds the token can enrol any device id: bulk and lab flashing."""
    max_enrolled: int = Field(default=1024, ge=0)
    """Devices enrolled with the fleet token at most (all runs of the state dir); past it
    new ids are refused, so a leaked token cannot grow the keyring without bound."""
    signing_key_file: Path | None = None
    """The coordinator's Ed25519 signing key (64 hex digits, mode 0600; python -m protocol
    keys --new-signing-key FILE writes it and FILE.pub): every frame on a fleet-wide topic
    (its status, the broadcast model) is signed with it and devices verify with FILE.pub
    (docs/protocol.md, section 2.5). Unset: STATE_DIR/coordinator-signing.key, made at
    the first start; without a state dir, a key for this run only."""
    insecure_no_auth: bool = False
    """Run without authentication: anyone on the broker can join, impersonate devices and
    poison the model. Tests and trusted networks only."""
    replay_window_s: float = Field(default=600.0, gt=0, allow_inf_nan=False)
    """Hellos and updates sent (their ts) further than this from the coordinator's clock
    are refused as replays (docs/protocol.md, section 7)."""
    broker: BrokerSettings | None = None
    """Connection settings (command line and file only; the sim passes its own)."""

    @model_validator(mode="after")
    def _resume_needs_state(self) -> CoordinatorConfig:
        if self.resume and self.state_dir is None:
            raise ValueError("resume needs a state_dir")
        if self.broadcast_model and self.sharing == "head":
            raise ValueError(
                "broadcast_model needs sharing full: with head sharing the fleet has no "
                "common feature extractor to serve"
            )
        return self

    def fingerprint_fields(self) -> dict[str, Any]:
        """Settings that must not change across ``--resume`` (the rest may)."""
        return (
            self.model_dump(
                mode="json",
                include={
                    "fleet",
                    "strategy",
                    "downlink",
                    "sharing",
                    "model",
                    "num_classes",
                    "in_channels",
                    "image_size",
                    "seed",
                },
            )
            | (  # absent at the default, so that runs persisted before the option resume
                {} if self.distill_data == "proxy" else {"distill_data": self.distill_data}
            )
            | ({} if self.input_shape is None else {"input_shape": list(self.input_shape)})
            | self._oneshot_fields()
        )

    def _oneshot_fields(self) -> dict[str, Any]:
        """The one-shot strategies' server step settings, which their result depends on:
        all of oneshot's; DENSE's where they are not the defaults (so that runs persisted
        before they counted still resume)."""
        sizes = {"dense_epochs", "dense_generator_steps", "dense_student_steps"}
        if self.strategy == "oneshot":
            return self.model_dump(mode="json", include={"oneshot_weighting", *sizes})
        if self.strategy == "dense":
            return self.model_dump(mode="json", include=sizes, exclude_defaults=True)
        return {}

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one input sample: ``input_shape``, or the images'
        ``(in_channels, image_size, image_size)``."""
        if self.input_shape is not None:
            return self.input_shape
        return (self.in_channels, self.image_size, self.image_size)


def run_weight_format(
    announced: WeightFormat, *, qat: bool, downlink: Precision, uplink: Precision
) -> WeightFormat:
    """The format a device runs its model at, as a run trains it: the format its hello
    ``announced``, except that a float device with an int8 link counts as int8 where the
    run asks for quantization-aware training (``qat``: it then trains, and runs, the int8
    model)."""
    if announced == "float" and qat and Precision.INT8 in (downlink, uplink):
        return "int8"
    return announced


def participants(participation: float, registered: int, online: int) -> int:
    """Devices to select in a round: ``max(1, round(C * K))`` capped by those online.

    ``K`` is the number of registered devices; returns 0 when none is online.
    """
    wanted = max(1, math.floor(participation * registered + 0.5))
    return min(wanted, online)


def load_config(path: Path, overrides: Mapping[str, Any] | None = None) -> CoordinatorConfig:
    """Read a TOML file into a :class:`CoordinatorConfig`, then apply ``overrides``.

    ``overrides`` are top-level keys (``training`` and ``broker`` are merged key by key).

    Raises:
        ConfigError: the file cannot be read, is not TOML, or has invalid settings.
    """
    try:
        data: dict[str, Any] = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    return build_config(data, overrides or {})


def build_config(data: Mapping[str, Any], overrides: Mapping[str, Any]) -> CoordinatorConfig:
    """Merge ``overrides`` into ``data`` and validate.

    Raises:
        ConfigError: invalid settings, with every problem listed.
    """
    merged: dict[str, Any] = dict(data)
    for key, value in overrides.items():
        if key in ("training", "broker") and isinstance(value, Mapping):
            section = dict(merged.get(key) or {})
            section.update(value)
            merged[key] = section
        else:
            merged[key] = value
    try:
        return CoordinatorConfig.model_validate(merged)
    except ValidationError as exc:
        tables: dict[str, type[BaseModel]] = {
            "training": TrainingSettings,
            "broker": BrokerSettings,
        }
        problems = settings_problems(exc, CoordinatorConfig, tables)
        raise ConfigError(f"invalid coordinator settings: {problems}") from exc


def settings_problems(
    exc: ValidationError, model: type[BaseModel], tables: Mapping[str, type[BaseModel]]
) -> str:
    """Every problem of ``exc`` (validating ``model``, whose ``tables`` are TOML tables of
    their own), one ``where: what`` each, ``; `` between; a key in the wrong place says
    where it belongs (``rounds is a top-level key, not a [training] one``)."""
    homes: dict[str, list[str]] = {}
    for name in model.model_fields:
        if name not in tables:
            homes.setdefault(name, []).append("a top-level key")
    for table, settings in tables.items():
        for name in settings.model_fields:
            homes.setdefault(name, []).append(f"a [{table}] key")
    problems = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        where, message = ".".join(loc) or "config", err["msg"]
        if err["type"] == "extra_forbidden" and len(loc) <= 2:
            here = f"a [{loc[0]}] one" if len(loc) == 2 else "a top-level one"
            home = homes.get(loc[-1])
            message = f"{loc[-1]} is {' or '.join(home)}, not {here}" if home else "unknown key"
        problems.append(f"{where}: {message}")
    return "; ".join(problems)
