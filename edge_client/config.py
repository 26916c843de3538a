"""The edge client's settings, declared once: its flags, its TOML file and its runtime config.

::

    DeviceOptions            what a device does (fleet, model, precisions, consent ...):
    ├── DeviceSettings         + how it is started: every flag of ``python -m edge_client
    │                            run`` / ``follow`` and every key of ``--config FILE``
    └── ClientConfig           + what the runtime needs: the broker, the key, time-outs
                                 and limits; what :class:`~edge_client.train.runtime.
                                 EdgeClient` and the sim's devices take

The command line derives its flags from :class:`DeviceSettings` with
:class:`protocol.flags.ModelFlags` (each field's docstring is its help, the model's
default its default); :func:`load_device_file` reads the same fields from a flat TOML
table whose keys are the flags without their dashes (``--device-id pi-07`` is
``device_id = "pi-07"``). :func:`device_settings` lays the flags given over the file,
and :meth:`DeviceSettings.client_config` resolves the settings (password, key files,
TLS) into the :class:`ClientConfig` the runtime takes. Values stay typed on the way
(a precision is a :class:`~protocol.tensors.Precision` from the file or flag to the
hello).

One file serves both commands: each takes the keys it has a flag for (:data:`RUN_KEYS`,
:data:`FOLLOW_KEYS`) and leaves the others (``follow`` has no ``data``). Relative paths
are taken from the file's folder. Secrets never live in the file: the MQTT password
comes from ``password_file`` (for example systemd's ``LoadCredential=``) or from the
environment variable named by ``password_env`` (default ``EDGEFL_MQTT_PASSWORD``, set
by an ``EnvironmentFile=``). A ``password`` key is refused. The TLS private key is a
file already (``tls_key``). Example (``/etc/edgefl/edgefl.toml``)::

    broker = "mqtts://broker.lab:8883"
    fleet = "lab"
    device_id = "pi-07"
    data = "/var/lib/edgefl/data.npz"
    state_dir = "/var/lib/edgefl/state"
    username = "pi-07"
    password_file = "/etc/edgefl/mqtt-password"
    tls_ca = "/etc/edgefl/ca.pem"
    threads = 4
    log_format = "journald"

Every problem raises :class:`~edge_client.errors.ConfigError` naming the key or flag
(pydantic's ``ValidationError``, a ``ValueError``, where a model is built directly).
Imports no torch: the inference-only profile reads the same file.
"""

from __future__ import annotations

import sys
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StringConstraints,
    ValidationError,
    model_validator,
)

from edge_client.errors import ConfigError
from protocol.auth import KEY_SIZE, Keyring, derive_device_key, read_fleet_token, read_key_file
from protocol.chunking import DEFAULT_MAX_PAYLOAD
from protocol.errors import TransportError
from protocol.messages import ID_PATTERN, WeightFormat
from protocol.signing import VerifyKey
from protocol.tensors import Precision
from protocol.transport.base import MqttVersion
from protocol.transport.config import PASSWORD_ENV, MqttConfig, TlsConfig, read_password

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 (JetPack 6)
    import tomli as tomllib

__all__ = [
    "FOLLOW_KEYS",
    "RUN_KEYS",
    "ClientConfig",
    "DeviceOptions",
    "DeviceSettings",
    "device_settings",
    "load_device_file",
]

_Identifier = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
_MAX_FILE_BYTES = 1 << 20


class DeviceOptions(BaseModel):
    """What a device does, the same in its settings and in its runtime config."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    fleet: _Identifier = "default"
    """Fleet name: the topic tree fl/{fleet}/ this device belongs to."""
    state_dir: Path | None = None
    """Folder for the client state (client_state.json: handled task ids, rounds done);
    none: nothing is kept across restarts."""
    insecure_no_auth: bool = False
    """Run without a key, tags neither written nor checked (tests and trusted networks
    only; a coordinator with keys refuses such a device)."""
    serve_onnx: Path | None = None
    """Keep this ONNX file current with the fleet's model, broadcast after each round by
    a coordinator run with --broadcast-model (with --onnx-template; python -m edge_client
    infer serves it)."""
    onnx_template: Path | None = None
    """ONNX template the served model is written into (python -m edge_client template);
    given together with --serve-onnx."""
    model: str = Field(default="lenet5", min_length=1, max_length=64)
    """Classifier name (models.classifier_names()) or a factory's import path
    package.module:factory (docs/models.md); the coordinator must train the same
    architecture (it checks the hello's fingerprint)."""
    threads: int = Field(default=1, ge=1, le=1024)
    """Torch threads for training (applied with torch.set_num_threads); announced in the
    hello."""
    init_seed: int = Field(default=0, ge=0)
    """Seed of the model's initial weights; use the coordinator's --seed, which gives the
    same ones (where only the head is shared, FedGen, the feature extractor starts
    here)."""
    downlink_precision: Precision | None = None
    """Ask for models in this precision, announced in the hello (unset: --precision,
    else the fleet's)."""
    uplink_precision: Precision | None = None
    """Upload updates in this precision, announced in the hello; lossy ones travel as
    deltas with error feedback (unset: --precision, else the fleet's)."""
    weight_format: WeightFormat = "float"
    """The number format this device runs its model's weights at, announced to the
    coordinator, which trains the device through it: float, int8 (the int8 ONNX model;
    quantization-aware where the run has --qat) or binary (binarized kernels, sign(w) *
    mean|w| per output channel, always trained binarized)."""
    share_label_counts: bool = False
    """Consent to send per-class label counts when a task asks (FedGen needs them);
    announced in the hello."""
    exit_when_finished: bool = False
    """Exit when the coordinator's run is finished, seen live (not when it stops or
    crashes: a stopped coordinator may resume; a retained "finished" of an earlier run is
    ignored)."""


class DeviceSettings(DeviceOptions):
    """Every flag of ``run`` / ``follow`` and every key of the device file, with the
    flags' defaults."""

    broker: str = "mqtt://127.0.0.1:1883"
    """Broker URL, mqtt://host[:port] or mqtts://host[:port]."""
    device_id: _Identifier | None = None
    """Device id, unique in the fleet (1-64 of A-Z a-z 0-9 and _-.); run: default, the
    data file's."""
    connect_retry: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    """Keep retrying the first connection this long, seconds."""
    username: str | None = None
    """MQTT user name."""
    password_file: Path | None = None
    """File holding the MQTT password."""
    password_env: str = Field(default=PASSWORD_ENV, pattern=_ENV_NAME)
    """Environment variable holding the MQTT password when no --password-file is given."""
    auth_key_file: Path | None = None
    """File holding this device's key, 64 hex digits (python -m deploy device writes
    it); every message is authenticated with it."""
    fleet_token_file: Path | None = None
    """Instead of --auth-key-file: file holding the fleet token, 64 hex digits (python -m
    protocol keys --new-fleet-token); this device's key is derived from it and the
    coordinator enrols the device on first contact (docs/protocol.md, 2.4)."""
    coordinator_key_file: Path | None = None
    """The coordinator's public signing key, 64 hex digits (its signing key file's .pub:
    python -m protocol keys --new-signing-key, python -m deploy, or the coordinator's
    STATE_DIR/coordinator-signing.key.pub): the coordinator's status and broadcast models
    are accepted only when signed with its key (docs/protocol.md, 2.5). Without it the
    device drops them (it still trains: its tasks come on its own authenticated topics);
    follow needs it."""
    tls_ca: Path | None = None
    """CA certificates (PEM) to verify the broker."""
    tls_cert: Path | None = None
    """Client certificate (PEM)."""
    tls_key: Path | None = None
    """Private key of --tls-cert (PEM)."""
    tls_insecure: bool = False
    """Skip the broker host name check (tests only)."""
    mqtt_version: MqttVersion = MqttVersion.V311
    """MQTT protocol version."""
    verbose: bool = False
    """Debug logging, else info."""
    log_format: Literal["auto", "text", "journald"] = "auto"
    """Log format; journald: one line per record with a syslog priority prefix; auto:
    journald when stderr is the journal."""
    data: Path | None = None
    """Device data .npz file (required by run)."""
    precision: Precision | None = None
    """Ask for this transfer precision both ways (unset: the fleet's);
    --downlink-precision and --uplink-precision set one direction."""
    memory_budget_mb: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Memory the client may use, MB; refuse to start when training cannot fit
    (default: the cgroup limit, such as systemd's MemoryMax, or the free memory)."""
    hello_timeout: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    """Seconds the device waits for the coordinator to answer its hello before it logs
    why none came (the fleet name, the broker or the key is likely wrong) and, with
    --exit-when-finished, exits with status 4; 0: wait silently forever."""

    def client_config(self, device_id: str) -> ClientConfig:
        """The runtime config of device ``device_id`` (its own, or the data file's):
        the password and the key read from their files, TLS settings checked.

        Raises:
            ConfigError: TLS settings without an mqtts:// broker, a file that is missing
                or unreadable, a bad key or fleet token, or an invalid setting.
        """
        tls_given = self.tls_ca or self.tls_cert or self.tls_key or self.tls_insecure
        if tls_given and not self.broker.startswith("mqtts://"):
            raise ConfigError("--tls-* options need an mqtts:// broker URL")
        for flag, path in (
            ("--tls-ca", self.tls_ca),
            ("--tls-cert", self.tls_cert),
            ("--tls-key", self.tls_key),
            ("--onnx-template", self.onnx_template),
        ):
            if path is not None and not path.is_file():
                raise ConfigError(f"{flag}: no such file {path}")
        tls = None
        if tls_given:
            tls = TlsConfig(
                ca_file=self.tls_ca,
                cert_file=self.tls_cert,
                key_file=self.tls_key,
                insecure=self.tls_insecure,
            )
        options = {name: getattr(self, name) for name in DeviceOptions.model_fields}
        options["downlink_precision"] = self.downlink_precision or self.precision
        options["uplink_precision"] = self.uplink_precision or self.precision
        options["hello_timeout_s"] = self.hello_timeout or None
        options["exit_when_refused"] = self.exit_when_finished
        return ClientConfig.from_broker_url(
            self.broker,
            device_id=device_id,
            tls=tls,
            username=self.username,
            password=self._password(),
            mqtt_version=self.mqtt_version,
            connect_retry_s=self.connect_retry,
            auth_key=self._auth_key(device_id),
            coordinator_key=self._coordinator_key(),
            **options,
        )

    def _password(self) -> str | None:
        try:
            password = read_password(self.password_file, self.password_env)
        except OSError as exc:
            raise ConfigError(f"cannot read password file {self.password_file}: {exc}") from exc
        return None if password is None else password.get_secret_value()

    def _auth_key(self, device_id: str) -> str | None:
        """This device's key as hex: read from the key file, or derived from the fleet
        token for ``device_id``; None without either.

        Raises:
            ConfigError: both given, or a file that is unreadable or not a 32-byte hex
                secret.
        """
        if self.auth_key_file is not None and self.fleet_token_file is not None:
            raise ConfigError("give --auth-key-file or --fleet-token-file, not both")
        try:
            if self.auth_key_file is not None:
                return read_key_file(self.auth_key_file).hex()
            if self.fleet_token_file is not None:
                token = read_fleet_token(self.fleet_token_file)
                return derive_device_key(token, device_id).hex()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        return None

    def _coordinator_key(self) -> str | None:
        """The coordinator's public key as hex, read from its file (None: none given).

        Raises:
            ConfigError: the file is unreadable or holds no public key.
        """
        if self.coordinator_key_file is None:
            return None
        try:
            return VerifyKey.load(self.coordinator_key_file).public.hex()
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


FOLLOW_KEYS: tuple[str, ...] = (
    "broker",
    "fleet",
    "device_id",
    "state_dir",
    "connect_retry",
    "username",
    "password_file",
    "password_env",
    "auth_key_file",
    "fleet_token_file",
    "coordinator_key_file",
    "insecure_no_auth",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "tls_insecure",
    "mqtt_version",
    "serve_onnx",
    "onnx_template",
    "verbose",
    "log_format",
)
"""The settings of ``follow`` (and of ``run``), in the order of the help: the broker, the
device's identity, serving and logs."""
RUN_KEYS: tuple[str, ...] = (
    *FOLLOW_KEYS,
    "data",
    "threads",
    "model",
    "init_seed",
    "precision",
    "downlink_precision",
    "uplink_precision",
    "weight_format",
    "share_label_counts",
    "exit_when_finished",
    "hello_timeout",
    "memory_budget_mb",
)
"""The settings of ``run``: those of ``follow`` and training's."""
_PATH_KEYS = tuple(
    name for name, field in DeviceSettings.model_fields.items() if field.annotation == Path | None
)


def load_device_file(path: Path) -> dict[str, Any]:
    """The settings a device configuration file sets, by key: validated and typed, with
    relative paths made absolute against the file's folder.

    Raises:
        ConfigError: the file cannot be read, is not TOML, holds a ``password``, a table,
            an unknown key or an invalid value (every problem is listed).
    """
    try:
        with path.open("rb") as handle:
            raw = handle.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    if len(raw) > _MAX_FILE_BYTES:
        raise ConfigError(f"config file {path} is larger than {_MAX_FILE_BYTES} bytes")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    if "password" in data:
        raise ConfigError(
            f"config file {path}: no 'password' key, please: keep the MQTT password out of "
            "the file, in password_file or in the environment variable named by "
            "password_env (default EDGEFL_MQTT_PASSWORD)"
        )
    nested = sorted(key for key, value in data.items() if isinstance(value, dict))
    if nested:
        raise ConfigError(
            f"config file {path}: the file is one flat table of flag names; "
            f"unexpected table(s) {', '.join(nested)}"
        )
    try:
        settings = DeviceSettings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"invalid device settings in {path}: {_problems(exc)}") from exc
    values = settings.model_dump(exclude_unset=True)
    folder = path.resolve().parent
    for key in _PATH_KEYS:
        value = values.get(key)
        if value is not None and not value.is_absolute():
            values[key] = folder / value
    return {key: value for key, value in values.items() if value is not None}


def device_settings(
    given: Mapping[str, Any], config_file: Path | None = None, keys: Collection[str] = RUN_KEYS
) -> DeviceSettings:
    """The settings of a command taking ``keys``: the flags ``given`` (field name ->
    value, as :meth:`protocol.flags.ModelFlags.given` returns them) over the file's keys
    among ``keys``, over the defaults.

    Raises:
        ConfigError: the file is invalid (:func:`load_device_file`) or a flag's value is
            (the message names the flag).
    """
    values: dict[str, Any] = {}
    if config_file is not None:
        values = {k: v for k, v in load_device_file(config_file).items() if k in keys}
    values.update(given)
    try:
        return DeviceSettings.model_validate(values)
    except ValidationError as exc:
        raise ConfigError(f"invalid device settings: {_problems(exc, flags=given)}") from exc


def _problems(exc: ValidationError, flags: Collection[str] = ()) -> str:
    """Every problem of ``exc``, one per key; a key in ``flags`` is named as its flag."""
    named = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "file"
        named.append(f"{'--' + key.replace('_', '-') if key in flags else key}: {err['msg']}")
    return "; ".join(named)


class ClientConfig(DeviceOptions):
    """How one edge device runs: identity, model, broker, persistence and limits."""

    device_id: _Identifier
    """This device's id: 1-64 of A-Z a-z 0-9 _ . -, unique in the fleet; in every topic
    the device publishes to."""
    broker: MqttConfig = Field(default_factory=MqttConfig)
    """Broker address, TLS, credentials, MQTT version, keepalive and reconnect backoff."""
    fsync_state: bool = True
    """fsync client_state.json (and its folder) on every save, so it survives a power
    loss; the emulator may turn it off for speed (the write stays atomic)."""
    task_timeout_s: float = Field(default=120.0, gt=0, allow_inf_nan=False)
    """How long a task waits for its model message before it is dropped, seconds."""
    stale_task_s: float = Field(default=600.0, ge=0, allow_inf_nan=False)
    """A task whose deadline passed more than this long ago (by this device's clock) is
    refused: a replay, or a leftover of an earlier run; the slack allows for clock skew
    (the coordinator's replay window is as wide)."""
    connect_retry_s: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    """How long start() keeps retrying the first connection (broker not up yet), s."""
    connect_backoff_s: float = Field(default=0.5, gt=0, allow_inf_nan=False)
    """First delay between connection attempts, seconds; doubled after each failure ..."""
    connect_backoff_max_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    """... up to this, seconds. (Reconnects after a lost session are the transport's.)"""
    upload_retry_s: float = Field(default=300.0, ge=0, allow_inf_nan=False)
    """How long an update is re-published while the broker is unreachable, seconds."""
    ack_timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    """How long a sent update waits for the coordinator's ack before it is sent again, s."""
    hello_timeout_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """How long a hello waits for the coordinator's ack before the device logs why none
    came and says hello again (or, with ``exit_when_refused``, stops), seconds; the wait
    doubles after each hint, up to 10 minutes. None: no watch (the emulator's devices).
    The command line sets it from ``--hello-timeout`` (default 60)."""
    exit_when_refused: bool = False
    """Stop (:attr:`~edge_client.train.runtime.EdgeClient.refusal` says why) when the
    coordinator refuses the hello (an authenticated nack), or when no coordinator
    answers it within ``hello_timeout_s`` while the fleet's coordinator is not known to
    be stopped or finished. The command line sets it with ``--exit-when-finished``;
    else a refused device stays up, logging why, and says hello again as before."""
    max_resends: int = Field(default=3, ge=0)
    """Times one update is sent again (no ack in time, or a retryable nack) before
    giving up."""
    max_buffered_models: int = Field(default=4, ge=1)
    """Model messages kept (by message id) for tasks that arrive after their model."""
    max_pending_tasks: int = Field(default=8, ge=1)
    """Tasks kept waiting for their model message; the oldest is dropped beyond this."""
    remember_tasks: int = Field(default=1024, ge=1)
    """Handled task message ids remembered (and persisted) to ignore redeliveries."""
    max_payload: int = Field(default=DEFAULT_MAX_PAYLOAD, ge=1024)
    """Largest MQTT payload published, bytes; larger updates are chunked."""
    auth_key: SecretStr | None = None
    """This device's 32-byte key as 64 hex digits (python -m deploy device writes it; the
    coordinator's keyring holds the same): every message to and from the device is
    authenticated with it (docs/protocol.md, section 2.3). Required unless
    insecure_no_auth."""
    coordinator_key: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    """The coordinator's 32-byte Ed25519 public key as 64 lowercase hex digits: frames on
    the fleet-wide topics (its status, the broadcast model) must carry its signature
    (docs/protocol.md, section 2.5). None: this device drops them (with keys; without,
    nothing is checked)."""

    @model_validator(mode="after")
    def _key_is_a_key(self) -> ClientConfig:
        if self.auth_key is not None:
            if self.insecure_no_auth:
                raise ValueError("give auth_key or insecure_no_auth, not both")
            try:
                key = bytes.fromhex(self.auth_key.get_secret_value())
            except ValueError:
                raise ValueError("auth_key must be 64 hex digits") from None
            if len(key) != KEY_SIZE:
                raise ValueError(f"auth_key must be {KEY_SIZE} bytes, not {len(key)}")
        return self

    def keyring(self) -> Keyring | None:
        """The keys this device authenticates its topics with (its own); None with
        ``insecure_no_auth``.

        Raises:
            ConfigError: neither a key nor ``insecure_no_auth``.
        """
        if self.auth_key is None:
            if self.insecure_no_auth:
                return None
            raise ConfigError(
                f"device {self.device_id} has no key: give --auth-key-file FILE (python -m "
                "deploy device writes it), --fleet-token-file FILE or --insecure-no-auth"
            )
        return Keyring({self.device_id: bytes.fromhex(self.auth_key.get_secret_value())})

    def fleet_key(self) -> VerifyKey | None:
        """The key fleet-wide frames are checked with (None: none given, or insecure).

        Raises:
            ConfigError: not a valid Ed25519 public key.
        """
        if self.coordinator_key is None or self.insecure_no_auth:
            return None
        try:
            return VerifyKey(bytes.fromhex(self.coordinator_key))
        except ValueError as exc:
            raise ConfigError(f"coordinator_key: {exc}") from exc

    @model_validator(mode="after")
    def _serving_needs_template(self) -> ClientConfig:
        if (self.serve_onnx is None) != (self.onnx_template is None):
            raise ValueError("serve_onnx and onnx_template are given together")
        return self

    @classmethod
    def from_broker_url(
        cls,
        url: str,
        *,
        device_id: str,
        tls: TlsConfig | None = None,
        username: str | None = None,
        password: str | None = None,
        mqtt_version: MqttVersion = MqttVersion.V311,
        client_id: str | None = None,
        **fields: Any,
    ) -> ClientConfig:
        """Build a config for a broker at ``mqtt://host[:port]`` or ``mqtts://host[:port]``.

        The MQTT client id defaults to ``device_id`` (so a broker ACL can use ``%c``, and
        a restarted device takes over its old session). ``tls`` replaces the default TLS
        settings of an ``mqtts://`` URL; ``username`` / ``password`` override those in
        the URL. ``fields`` set the other :class:`ClientConfig` fields.

        Raises:
            ConfigError: the URL, a broker setting or a field is invalid.
        """
        overrides: dict[str, Any] = {"client_id": client_id or device_id, "version": mqtt_version}
        if tls is not None:
            overrides["tls"] = tls
        if username is not None:
            overrides["username"] = username
        if password is not None:
            overrides["password"] = SecretStr(password)
        try:
            broker = MqttConfig.from_url(url, **overrides)
            return cls(device_id=device_id, broker=broker, **fields)
        except (TransportError, ValidationError) as exc:
            raise ConfigError(f"invalid client configuration: {exc}") from exc
