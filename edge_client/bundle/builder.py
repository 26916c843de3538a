"""Offline install bundles for boards: ``python -m edge_client bundle --out DIR ...``.

A bundle is a folder that installs the edge client on a board with no network::

    wheels/                  every wheel the profile needs for the board's platform and
                             Python (pip's cross-platform download), and the project's
    install.sh               makes a virtual environment from wheels/ (pip --no-index),
                             installs the config and the systemd unit, starts the service
    edgefl-client.service    the unit: restarts on failure, MemoryMax / CPUQuota limits,
                             SIGTERM to stop, logs to the journal
    edgefl.toml              the device config (--config), else edgefl.toml.example
    template.onnx            the ONNX template of a served model (--onnx-template)
    coordinator.pub          the coordinator's public signing key (--coordinator-key): the
                             device checks the coordinator's status and broadcast models
                             with it (coordinator_key_file)
    BUNDLE.json              what was built: profile, platform, Python, torch source,
                             files with sizes and SHA-256

Where torch comes from is a flag, never a guess (``--torch-index``): a Raspberry Pi takes
PyTorch's CPU wheels (``cpu``: https://download.pytorch.org/whl/cpu; PyPI's aarch64 torch
is a CUDA build of about 430 MB plus the NVIDIA libraries, useless on a Pi), a Jetson
takes NVIDIA's wheels for its JetPack release (the URL of an index of them, or a folder
holding the wheel downloaded by hand), and ``default`` takes pip's own configuration (its
index and find-links). Torch is downloaded alone from
that source; everything else comes from pip's index (plus ``--extra-index-url``, e.g.
piwheels for 32-bit Raspberry Pi OS), with torch pinned to the version downloaded.

Imports only the standard library (the bundle is built on a workstation; pip does the
downloading in a subprocess).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import platform as host_platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from edge_client.errors import EdgeClientError

__all__ = [
    "PLATFORMS",
    "TORCH_INDEXES",
    "BundleError",
    "BundleOptions",
    "BundleReport",
    "DownloadError",
    "build_bundle",
]

logger = logging.getLogger(__name__)

PLATFORMS: dict[str, str] = {
    "linux_aarch64": "aarch64",  # Raspberry Pi 4/5 (64-bit OS), Jetson Orin / Xavier
    "linux_armv7l": "armv7l",  # 32-bit Raspberry Pi OS (few wheels: add piwheels)
    "linux_x86_64": "x86_64",  # x86 gateways, and this kind of machine
}
"""Target platforms, with the ``uname -m`` they run on."""

TORCH_INDEXES: dict[str, str] = {"cpu": "https://download.pytorch.org/whl/cpu"}
"""Named torch sources; any index URL is accepted too, and ``default``."""

DEFAULT_MEMORY_MAX = {"train": "1G", "infer": "256M"}
PROJECT = "edgefl"
UNIT_NAME = "edgefl-client.service"
CONFIG_NAME = "edgefl.toml"
TEMPLATE_NAME = "template.onnx"
COORDINATOR_KEY_NAME = "coordinator.pub"
_GLIBC_MINORS = range(17, 36)  # manylinux_2_17 .. manylinux_2_35 (Bookworm 2.36, JP6 2.35)
_SYSTEMD_SIZE = re.compile(r"^(\d+(\.\d+)?[KMGT]?|infinity)$")
_CPU_QUOTA = re.compile(r"^\d+%$")
_PY_VERSION = re.compile(r"^3\.(\d+)$")

Progress = Callable[[str], object]


class BundleError(EdgeClientError, ValueError):
    """The bundle cannot be built as asked (options, output folder, config, sources)."""


class DownloadError(EdgeClientError):
    """pip could not build or download a wheel; the message has pip's own last lines."""


@dataclass(frozen=True)
class BundleOptions:
    """What ``python -m edge_client bundle`` was asked for; see its ``--help``."""

    out: Path
    profile: Literal["train", "infer"] = "train"
    platform: str = "native"
    python_version: str | None = None
    torch_index: str | None = None
    torch_version: str | None = None
    config: Path | None = None
    onnx_template: Path | None = None
    coordinator_key: Path | None = None
    memory_max: str | None = None
    cpu_quota: str = "300%"
    extra_index_urls: tuple[str, ...] = ()


@dataclass(frozen=True)
class BundleReport:
    """What was built."""

    out: Path
    profile: str
    platform: str
    python_version: str
    torch_wheel: str | None
    files: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    def summary(self) -> str:
        wheels = sum(1 for name in self.files if name.startswith("wheels/"))
        torch = f", torch {self.torch_wheel}" if self.torch_wheel else ""
        return (
            f"bundle {self.out}: profile {self.profile}, {self.platform}, Python "
            f"{self.python_version}, {wheels} wheels{torch}, {self.total_bytes / 1e6:.1f} MB; "
            f"install on the board with: sudo sh {self.out.name}/install.sh"
        )


def build_bundle(options: BundleOptions, progress: Progress = logger.info) -> BundleReport:
    """Build the bundle ``options`` describes into ``options.out``.

    Raises:
        BundleError: invalid options, an output folder that is not empty, an invalid
            device config, or no project source to build the wheel from.
        DownloadError: pip failed (a wheel missing for the platform, no network, ...).
    """
    plan = _Plan.make(options)
    out = options.out
    wheels = out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    progress(f"building the {PROJECT} wheel from {plan.source}")
    project_wheel = _build_project_wheel(plan.source, wheels)
    torch_wheel = None
    constraints: list[str] = []
    if options.profile == "train":
        progress(f"downloading torch for {plan.platform} from {plan.torch_source}")
        torch_wheel = _download_torch(plan, wheels)
        constraints.append(f"torch=={_wheel_version(torch_wheel)}")
    progress(f"downloading the {options.profile} profile's wheels for {plan.platform}")
    requirements = [f"{PROJECT}[{options.profile}] @ {project_wheel.resolve().as_uri()}"]
    if plan.python_version == "3.10":  # pip evaluates markers for this interpreter
        requirements.append("tomli>=2.0")
    _pip_download(plan, wheels, requirements, constraints=constraints)
    _write_files(plan, options, project_wheel)
    files = {
        str(path.relative_to(out)): path.stat().st_size
        for path in sorted(out.rglob("*"))
        if path.is_file()
    }
    report = BundleReport(
        out=out,
        profile=options.profile,
        platform=plan.platform,
        python_version=plan.python_version,
        torch_wheel=None if torch_wheel is None else torch_wheel.name,
        files=files,
    )
    _write_manifest(report, plan)
    return report


@dataclass(frozen=True)
class _Plan:
    """Checked options: where the source is, the pip flags of the target."""

    source: Path
    platform: str
    arch: str
    python_version: str
    target_flags: tuple[str, ...]
    torch_source: str
    torch_index: str | None  # None: pip's configured indexes
    torch_version: str | None

    @classmethod
    def make(cls, options: BundleOptions) -> _Plan:
        if options.profile not in ("train", "infer"):
            raise BundleError(f"unknown profile {options.profile!r}: train or infer")
        _check_out(options.out)
        native = options.platform == "native"
        if native:
            system, machine = host_platform.system().lower(), host_platform.machine()
            target = f"{system}_{machine}"
            if target not in PLATFORMS:
                raise BundleError(f"this machine ({target}) is not a supported target")
        elif options.platform in PLATFORMS:
            target = options.platform
        else:
            raise BundleError(
                f"unknown platform {options.platform!r}: {', '.join(PLATFORMS)} or native"
            )
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        python_version = options.python_version or here
        match = _PY_VERSION.match(python_version)
        if match is None or int(match.group(1)) < 10:
            raise BundleError(
                f"--python-version must be 3.10 or newer as X.Y, not {python_version}"
            )
        flags: list[str] = ["--only-binary=:all:"]
        if not native or python_version != here:
            arch = PLATFORMS[target]
            tags = [f"manylinux_2_{minor}_{arch}" for minor in reversed(_GLIBC_MINORS)]
            tags += [f"manylinux2014_{arch}", f"linux_{arch}"]
            for tag in tags:
                flags += ["--platform", tag]
            flags += ["--python-version", python_version, "--implementation", "cp"]
        for url in options.extra_index_urls:
            flags += ["--extra-index-url", url]
        torch_index, torch_source = None, "pip's configured index"
        if options.profile == "train":
            if options.torch_index is None:
                raise BundleError(
                    "the train profile needs --torch-index: 'cpu' for a Raspberry Pi "
                    "(PyTorch's CPU wheels), the URL of NVIDIA's index for your JetPack on "
                    "a Jetson, or 'default' for pip's configured index"
                )
            if Path(options.torch_index).is_dir():  # wheels downloaded by hand (Jetson)
                torch_index = str(Path(options.torch_index).resolve())
                torch_source = f"the wheels in {torch_index}"
            elif options.torch_index != "default":
                torch_index = TORCH_INDEXES.get(options.torch_index, options.torch_index)
                if not torch_index.startswith(("https://", "http://", "file:")):
                    raise BundleError(
                        f"--torch-index {options.torch_index!r} is neither "
                        f"{', '.join(TORCH_INDEXES)}, default, a URL nor a folder"
                    )
                torch_source = torch_index
        elif options.torch_index is not None or options.torch_version is not None:
            raise BundleError("--torch-index / --torch-version: the infer profile has no torch")
        for name, value, pattern in (
            ("--memory-max", options.memory_max, _SYSTEMD_SIZE),
            ("--cpu-quota", options.cpu_quota, _CPU_QUOTA),
        ):
            if value is not None and not pattern.match(value):
                raise BundleError(f"{name} {value!r} is not a systemd value (e.g. 1G, 300%)")
        if options.onnx_template is not None and not options.onnx_template.is_file():
            raise BundleError(f"--onnx-template: no such file {options.onnx_template}")
        if options.coordinator_key is not None:
            _check_public_key(options.coordinator_key)
        if options.config is not None:
            _check_config(options.config)
        return cls(
            source=_project_source(),
            platform=target,
            arch=PLATFORMS[target],
            python_version=python_version,
            target_flags=tuple(flags),
            torch_source=torch_source,
            torch_index=torch_index,
            torch_version=options.torch_version,
        )


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BundleError(f"--out {out} exists and is not an empty folder")


def _check_config(path: Path) -> None:
    from edge_client.config import load_device_file

    try:
        load_device_file(path)
    except EdgeClientError as exc:
        raise BundleError(str(exc)) from exc


def _project_source() -> Path:
    """The source tree this package was loaded from (the bundle builds its wheel)."""
    root = Path(__file__).resolve().parents[2]  # edge_client/bundle/builder.py
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file() or f'name = "{PROJECT}"' not in pyproject.read_text("utf-8"):
        raise BundleError(
            f"no {PROJECT} source tree at {root}: run the bundle command from a checkout "
            "(pip install -e .), which it builds the project's wheel from"
        )
    return root


def _run_pip(args: Sequence[str], what: str) -> None:
    command = [sys.executable, "-m", "pip", *args]
    logger.debug("running %s", " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = " | ".join(line for line in done.stderr.strip().splitlines()[-6:] if line)
        raise DownloadError(f"{what} failed (pip exit {done.returncode}): {tail}")


_PACKAGES = (
    "protocol",
    "models",
    "edge_client",
    "coordinator",
    "sim",
    "deploy",
    "edgefl_examples",  # the worked examples' models, which their devices build
)


def _build_project_wheel(source: Path, wheels: Path) -> Path:
    """Build the project's wheel from a clean copy of the source (setuptools would reuse a
    stale ``build/`` folder of the checkout)."""
    with tempfile.TemporaryDirectory(prefix="edgefl-wheel-") as tmp:
        tree, out = Path(tmp) / "src", Path(tmp) / "dist"
        tree.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copyfile(source / name, tree / name)
        skip = shutil.ignore_patterns("__pycache__", "*.pyc")
        for package in _PACKAGES:
            shutil.copytree(source / package, tree / package, ignore=skip)
        args = ["wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(tree)]
        if importlib.util.find_spec("setuptools") is not None:
            args.insert(1, "--no-build-isolation")  # build with it, download nothing
        _run_pip(args, f"building the {PROJECT} wheel")
        (built,) = out.glob(f"{PROJECT}-*.whl")
        target = wheels / built.name
        shutil.copyfile(built, target)
    return target


def _download_torch(plan: _Plan, wheels: Path) -> Path:
    """torch alone, from its source (its dependencies come with the rest)."""
    before = set(wheels.glob("torch-*.whl"))
    args = ["download", "--no-deps", "--quiet", "--dest", str(wheels), *plan.target_flags]
    if plan.torch_index is not None and Path(plan.torch_index).is_dir():
        args += ["--no-index", "--find-links", plan.torch_index]
    elif plan.torch_index is not None:
        args += ["--index-url", plan.torch_index]
    args.append(f"torch=={plan.torch_version}" if plan.torch_version else "torch>=2.2")
    _run_pip(args, f"downloading torch for {plan.platform}, Python {plan.python_version}")
    found = sorted(set(wheels.glob("torch-*.whl")) - before)
    if len(found) != 1:
        raise DownloadError(f"expected one new torch wheel in {wheels}, found {len(found)}")
    return found[0]


def _wheel_version(wheel: Path) -> str:
    """The version in a wheel's file name (``torch-2.13.0+cpu-cp311-...``: 2.13.0+cpu)."""
    return wheel.name.split("-")[1]


def _pip_download(
    plan: _Plan, wheels: Path, requirements: Sequence[str], *, constraints: Sequence[str]
) -> None:
    with tempfile.TemporaryDirectory(prefix="edgefl-bundle-") as tmp:
        args = ["download", "--quiet", "--dest", str(wheels), "--find-links", str(wheels)]
        args += list(plan.target_flags)
        if constraints:
            pins = Path(tmp) / "constraints.txt"
            pins.write_text("\n".join(constraints) + "\n", encoding="utf-8")
            args += ["--constraint", str(pins)]
        _run_pip([*args, *requirements], f"downloading the wheels for {plan.platform}")


def _write_files(plan: _Plan, options: BundleOptions, project_wheel: Path) -> None:
    out = options.out
    command = "run" if options.profile == "train" else "follow"
    values = {
        "@PROFILE@": options.profile,
        "@COMMAND@": command,
        "@PYTHON_VERSION@": plan.python_version,
        "@ARCH@": plan.arch,
        "@VERSION@": _wheel_version(project_wheel),
        "@MEMORY_MAX@": options.memory_max or DEFAULT_MEMORY_MAX[options.profile],
        "@CPU_QUOTA@": options.cpu_quota,
        "@TORCH_SOURCE@": plan.torch_source if options.profile == "train" else "none",
    }
    for name, text, mode in (
        ("install.sh", _INSTALL_SH, 0o755),
        (UNIT_NAME, _UNIT, 0o644),
    ):
        rendered = text
        for key, value in values.items():
            rendered = rendered.replace(key, value)
        path = out / name
        path.write_text(rendered, encoding="utf-8")
        path.chmod(mode)
    if options.config is not None:
        shutil.copyfile(options.config, out / CONFIG_NAME)
    else:
        example = _EXAMPLE_TRAIN if options.profile == "train" else _EXAMPLE_INFER
        (out / f"{CONFIG_NAME}.example").write_text(example, encoding="utf-8")
    if options.onnx_template is not None:
        shutil.copyfile(options.onnx_template, out / TEMPLATE_NAME)
    if options.coordinator_key is not None:
        shutil.copyfile(options.coordinator_key, out / COORDINATOR_KEY_NAME)


def _check_public_key(path: Path) -> None:
    """A public key file holds 64 hex digits (checked here without importing the
    protocol's crypto: the builder imports only the standard library).

    Raises:
        BundleError: unreadable, or not 32 bytes of hex.
    """
    try:
        raw = bytes.fromhex(path.read_text(encoding="utf-8").strip())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise BundleError(f"--coordinator-key: cannot read a hex key from {path}: {exc}") from None
    if len(raw) != 32:
        raise BundleError(f"--coordinator-key: {path} holds {len(raw)} bytes, not a 32-byte key")


def _write_manifest(report: BundleReport, plan: _Plan) -> None:
    files = {}
    for name, size in report.files.items():
        digest = hashlib.sha256((report.out / name).read_bytes()).hexdigest()
        files[name] = {"bytes": size, "sha256": digest}
    manifest = {
        "profile": report.profile,
        "platform": report.platform,
        "python_version": report.python_version,
        "torch_source": plan.torch_source if report.profile == "train" else None,
        "torch_wheel": report.torch_wheel,
        "total_bytes": report.total_bytes,
        "files": files,
    }
    (report.out / "BUNDLE.json").write_text(json.dumps(manifest, indent=1) + "\n", "utf-8")


_UNIT = """\
# The edgefl edge client (@PROFILE@ profile), installed by install.sh.
[Unit]
Description=edgefl edge client (@PROFILE@)
Wants=network-online.target
After=network-online.target
# keep restarting however often it fails (the broker may be away for days)
StartLimitIntervalSec=0

[Service]
Type=simple
User=edgefl
Group=edgefl
ExecStart=@PREFIX@/venv/bin/python -m edge_client @COMMAND@ --config @CONFIG_DIR@/edgefl.toml
Restart=on-failure
RestartSec=10s
# exit 2: bad configuration or not enough memory; 3: the coordinator refused this device
# (its model or data do not fit the fleet): restarting would not help
RestartPreventExitStatus=2 3
# SIGTERM: the client finishes its current training step, abandons an upload cleanly
KillSignal=SIGTERM
TimeoutStopSec=60s
MemoryMax=@MEMORY_MAX@
CPUQuota=@CPU_QUOTA@
Nice=5
# the MQTT password: EDGEFL_MQTT_PASSWORD=... in this file (or password_file)
EnvironmentFile=-@CONFIG_DIR@/edgefl.env
Environment=PYTHONUNBUFFERED=1
SyslogIdentifier=edgefl
StateDirectory=edgefl
StateDirectoryMode=0750
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=yes
PrivateTmp=yes

[Install]
WantedBy=multi-user.target
"""

_INSTALL_SH = r"""#!/bin/sh
# Installs the edgefl edge client (@PROFILE@ profile) from this bundle, with no network.
# Built for Python @PYTHON_VERSION@ on @ARCH@; torch from: @TORCH_SOURCE@.
set -eu

usage() {
    cat <<'EOF'
usage: sudo sh install.sh [--prefix DIR] [--config-dir DIR] [--unit-dir DIR]
                          [--python PYTHON] [--no-service]

  --prefix DIR      where the virtual environment goes (default /opt/edgefl)
  --config-dir DIR  edgefl.toml, edgefl.env, template.onnx, coordinator.pub
                    (default /etc/edgefl)
  --unit-dir DIR    where the systemd unit goes (default /etc/systemd/system)
  --python PYTHON   the board's Python @PYTHON_VERSION@ (default python3)
  --no-service      install only: no user, no unit, nothing started
EOF
}

here=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd)
prefix=/opt/edgefl
config_dir=/etc/edgefl
unit_dir=/etc/systemd/system
python=python3
service=1
while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) prefix=$2; shift 2 ;;
        --config-dir) config_dir=$2; shift 2 ;;
        --unit-dir) unit_dir=$2; shift 2 ;;
        --python) python=$2; shift 2 ;;
        --no-service) service=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done

fail() { echo "install.sh: error: $*" >&2; exit 1; }
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$(pwd)/$1" ;; esac; }
prefix=$(absolute "$prefix"); config_dir=$(absolute "$config_dir"); unit_dir=$(absolute "$unit_dir")
cd /  # nothing of the current folder on the new environment's import path

arch=$(uname -m)
[ "$arch" = "@ARCH@" ] || fail "this bundle is for @ARCH@, this machine is $arch"
command -v "$python" >/dev/null 2>&1 || fail "$python not found"
have=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$have" = "@PYTHON_VERSION@" ] || fail "this bundle is for Python @PYTHON_VERSION@, \
$python is $have (rebuild it with --python-version $have)"

echo "== virtual environment in $prefix/venv"
"$python" -m venv "$prefix/venv" || fail "python -m venv failed (Debian: apt install python3-venv)"
# No index, no user or global pip configuration: the wheels of this bundle only.
PIP_CONFIG_FILE=/dev/null "$prefix/venv/bin/python" -m pip install --quiet --no-index \
    --no-cache-dir --disable-pip-version-check --find-links "$here/wheels" \
    "edgefl[@PROFILE@]==@VERSION@"

echo "== configuration in $config_dir"
mkdir -p "$config_dir"
if [ -f "$here/edgefl.toml" ]; then
    if [ -f "$config_dir/edgefl.toml" ]; then
        echo "kept the existing $config_dir/edgefl.toml"
    else
        cp "$here/edgefl.toml" "$config_dir/edgefl.toml"
        chmod 0640 "$config_dir/edgefl.toml"
    fi
elif [ ! -f "$config_dir/edgefl.toml" ]; then
    cp "$here/edgefl.toml.example" "$config_dir/edgefl.toml.example"
    echo "no edgefl.toml in the bundle: write $config_dir/edgefl.toml from the example"
fi
if [ -f "$here/template.onnx" ]; then
    cp "$here/template.onnx" "$config_dir/template.onnx"
    chmod 0644 "$config_dir/template.onnx"
fi
if [ -f "$here/coordinator.pub" ]; then
    cp "$here/coordinator.pub" "$config_dir/coordinator.pub"
    chmod 0644 "$config_dir/coordinator.pub"
fi

echo "== checking the installation"
"$prefix/venv/bin/python" -m edge_client @COMMAND@ --help >/dev/null
if [ "@PROFILE@" = "train" ]; then
    check='import torch, edge_client.train.runtime; print("torch", torch.__version__)'
else
    check='import onnxruntime as o, edge_client.serve.follower; print("onnxruntime", o.__version__)'
fi
"$prefix/venv/bin/python" -c "$check"

if [ "$service" = 0 ]; then
    echo "installed; run: $prefix/venv/bin/python -m edge_client @COMMAND@ \
--config $config_dir/edgefl.toml"
    exit 0
fi

echo "== service edgefl-client"
[ "$(id -u)" = 0 ] || fail "the service needs root (sudo), or pass --no-service"
command -v systemctl >/dev/null 2>&1 || fail "no systemctl: pass --no-service"
if ! id edgefl >/dev/null 2>&1; then
    useradd --system --no-create-home --home-dir /var/lib/edgefl --shell /usr/sbin/nologin edgefl
fi
chgrp edgefl "$config_dir" "$config_dir"/edgefl.* 2>/dev/null || true
chmod 0750 "$config_dir"
sed -e "s|@PREFIX@|$prefix|g" -e "s|@CONFIG_DIR@|$config_dir|g" \
    "$here/edgefl-client.service" > "$unit_dir/edgefl-client.service"
systemctl daemon-reload
if [ -f "$config_dir/edgefl.toml" ]; then
    systemctl enable --now edgefl-client.service
    echo "started; health: systemctl status edgefl-client, journalctl -u edgefl-client -f"
else
    systemctl enable edgefl-client.service
    echo "enabled; write $config_dir/edgefl.toml, then: systemctl start edgefl-client"
fi
"""

_EXAMPLE_TRAIN = """\
# edgefl device configuration (python -m edge_client run --config FILE): every flag of
# python -m edge_client run is a key. Secrets stay out of this file: the MQTT password
# goes into password_file, or into EDGEFL_MQTT_PASSWORD=... in /etc/edgefl/edgefl.env.
broker = "mqtts://broker.example:8883"
fleet = "lab"
device_id = "pi-01"
username = "pi-01"
password_file = "/etc/edgefl/mqtt-password"
tls_ca = "/etc/edgefl/ca.pem"
data = "/var/lib/edgefl/data.npz"
state_dir = "/var/lib/edgefl/state"
threads = 4
# the coordinator's public signing key (bundle --coordinator-key installs it here):
coordinator_key_file = "/etc/edgefl/coordinator.pub"
# keep a local ONNX model current for python -m edge_client infer:
# serve_onnx = "/var/lib/edgefl/model.onnx"
# onnx_template = "/etc/edgefl/template.onnx"
"""

_EXAMPLE_INFER = """\
# edgefl device configuration (python -m edge_client follow --config FILE): every flag of
# python -m edge_client follow is a key. Secrets stay out of this file: the MQTT password
# goes into password_file, or into EDGEFL_MQTT_PASSWORD=... in /etc/edgefl/edgefl.env.
broker = "mqtts://broker.example:8883"
fleet = "lab"
device_id = "cam-01"
username = "cam-01"
password_file = "/etc/edgefl/mqtt-password"
tls_ca = "/etc/edgefl/ca.pem"
serve_onnx = "/var/lib/edgefl/model.onnx"
onnx_template = "/etc/edgefl/template.onnx"
coordinator_key_file = "/etc/edgefl/coordinator.pub"
"""
