"""Configuration of the edge client runtime: one frozen pydantic object, named defaults.

Invalid values raise pydantic's ``ValidationError`` (a ``ValueError``) on construction;
:meth:`ClientConfig.from_broker_url` converts every problem to
:class:`~edge_client.errors.ConfigError`. Argument parsing lives in ``__main__`` only;
the runtime takes this object. Imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

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
from protocol.auth import KEY_SIZE, Keyring
from protocol.chunking import DEFAULT_MAX_PAYLOAD
from protocol.errors import TransportError
from protocol.messages import ID_PATTERN, WeightFormat
from protocol.tensors import Precision
from protocol.transport.base import MqttVersion
from protocol.transport.config import MqttConfig, TlsConfig

__all__ = ["ClientConfig"]

_Identifier = Annotated[str, StringConstraints(pattern=ID_PATTERN)]


class ClientConfig(BaseModel):
    """How one edge device runs: identity, model, broker, persistence and limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device_id: _Identifier
    # This device's id: 1-64 of A-Z a-z 0-9 _ . -, unique in the fleet; in every topic
    # the device publishes to.
    fleet: _Identifier = "default"
    # The fleet (topic tree fl/{fleet}/...) this device belongs to.
    model: str = Field(default="lenet5", min_length=1, max_length=64)
    # Registry name of the classifier (models.classifier_names()); the coordinator
    # must train the same architecture (it checks the hello's fingerprint).
    broker: MqttConfig = Field(default_factory=MqttConfig)
    # Broker address, TLS, credentials, MQTT version, keepalive and reconnect backoff.
    state_dir: Path | None = None
    # Folder for client_state.json (handled task ids, rounds done); None: nothing is
    # kept across restarts.
    fsync_state: bool = True
    # fsync client_state.json (and its folder) on every save, so it survives a power
    # loss; the emulator may turn it off for speed (the write stays atomic).
    threads: int = Field(default=1, ge=1, le=1024)
    # Threads for training (the CLI applies it with torch.set_num_threads); announced
    # in the hello.
    init_seed: int = Field(default=0, ge=0)
    # Seed of the local model's initial weights (the coordinator's --seed gives the same
    # ones); where only the head is shared (FedGen), the feature extractor starts here.
    downlink_precision: Precision | None = None
    # Precision to receive models in (announced in the hello); None: the fleet's.
    uplink_precision: Precision | None = None
    # Precision to upload updates in; lossy ones travel as deltas with error feedback.
    # None: the fleet's.
    weight_format: WeightFormat = "float"
    # The number format the device runs its model's weights at (announced in the hello):
    # float, int8 (the int8 ONNX model) or binary (binarized kernels, sign(w) * mean|w|
    # per output channel); the coordinator trains the device through it.
    share_label_counts: bool = False
    # Consent to send per-class label counts when a task asks for them (FedGen needs
    # them). Off by default; announced in the hello.
    exit_when_finished: bool = False
    # Stop the client when the coordinator's status becomes "finished" (after the client
    # saw it live: a retained "finished" of an earlier run is ignored). "stopped" (also
    # the coordinator's last will) does not stop it: the coordinator may resume.
    task_timeout_s: float = Field(default=120.0, gt=0, allow_inf_nan=False)
    # How long a task waits for its model message before it is dropped, seconds.
    connect_retry_s: float = Field(default=60.0, ge=0, allow_inf_nan=False)
    # How long start() keeps retrying the first connection (broker not up yet), seconds.
    connect_backoff_s: float = Field(default=0.5, gt=0, allow_inf_nan=False)
    # First delay between connection attempts, seconds; doubled after each failure ...
    connect_backoff_max_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    # ... up to this, seconds. (Reconnects after a lost session are the transport's.)
    upload_retry_s: float = Field(default=300.0, ge=0, allow_inf_nan=False)
    # How long an update is re-published while the broker is unreachable, seconds.
    ack_timeout_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    # How long a sent update waits for the coordinator's ack before it is sent again, s.
    max_resends: int = Field(default=3, ge=0)
    # Times one update is sent again (no ack in time, or a retryable nack) before giving up.
    max_buffered_models: int = Field(default=4, ge=1)
    # Model messages kept (by message id) for tasks that arrive after their model.
    max_pending_tasks: int = Field(default=8, ge=1)
    # Tasks kept waiting for their model message; the oldest is dropped beyond this.
    remember_tasks: int = Field(default=1024, ge=1)
    # Handled task message ids remembered (and persisted) to ignore redeliveries.
    max_payload: int = Field(default=DEFAULT_MAX_PAYLOAD, ge=1024)
    # Largest MQTT payload published, bytes; larger updates are chunked.
    auth_key: SecretStr | None = None
    # This device's 32-byte key as 64 hex digits (python -m deploy device writes it;
    # the coordinator's keyring holds the same): every message to and from the device is
    # authenticated with it (docs/protocol.md, section 2.3). Required unless
    # insecure_no_auth.
    insecure_no_auth: bool = False
    # Run without a key: tags are neither written nor checked (tests and trusted networks
    # only; a coordinator with keys refuses such a device).
    serve_onnx: Path | None = None
    # Keep this ONNX file current with the fleet's model, broadcast after each round by a
    # coordinator run with --broadcast-model (python -m edge_client infer serves it).
    onnx_template: Path | None = None
    # The ONNX template the served model is written into (python -m edge_client
    # template); given together with serve_onnx.

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
