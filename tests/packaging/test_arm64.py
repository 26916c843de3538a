"""An aarch64 infer bundle on a board that is not this machine: a Debian bookworm arm64
root (Raspberry Pi OS 12's base) run under qemu-user emulation.

``bash .ci/arm64-root`` builds the root (and registers qemu's aarch64 interpreter with
binfmt_misc); ``EDGEFL_ARM64_ROOT`` names it. Without it these tests skip, unless
``EDGEFL_REQUIRE_ARM64=1`` (CI), which makes them fail instead.

``python -m edge_client bundle --platform linux_aarch64`` builds the infer bundle here;
its ``install.sh --no-service`` installs it inside the root (chroot, no systemd, no
network: the bundle's wheels only). Then, with no torch on the board:

- ``python -m edge_client infer`` there predicts what onnxruntime here predicts with the
  final ONNX model of a one-round run of the real coordinator (one host device trains);
- ``python -m edge_client follow`` there, against that coordinator over Mosquitto on
  127.0.0.1 (a chroot shares this machine's network), receives the broadcast model and
  writes its ``serve_onnx`` file, which ``infer`` there classifies with.

Every command inside the root runs as ``unshare --mount`` + ``chroot`` with ``/proc``
mounted in that private mount namespace only, so nothing stays mounted when it ends.
``/sys`` is left out on purpose: under qemu-user (Debian's 7.2) the root sees the host's
x86 ``/proc/cpuinfo``; with ``/proc`` and ``/sys`` both mounted, onnxruntime's extension
segfaults as it is imported (its cpuinfo library trusts /sys's CPU lists, then reads the
x86 /proc/cpuinfo), with either alone it only warns. A real board has both, and an ARM
/proc/cpuinfo.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from edge_client.serve.infer import OnnxClassifier
from tests.packaging.helpers import (
    ROOT,
    SIDE,
    bundle_command,
    coordinator_public_key,
    provision_keys,
    run,
    run_coordinator,
    write_fleet_files,
)
from tests.protocol.brokers import Mosquitto

pytestmark = [
    pytest.mark.arm64,
    pytest.mark.mosquitto,
    pytest.mark.slow,
    # the first test builds the bundle and installs it under emulation (about 2-3 min)
    pytest.mark.timeout(1200),
]

ROOT_ENV, REQUIRE_ENV = "EDGEFL_ARM64_ROOT", "EDGEFL_REQUIRE_ARM64"
FLEET = "arm64"
BINFMT = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
ENV = ("PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/root", "LANG=C.UTF-8")
"""The whole environment of a command in the root: nothing of this machine's (no
PYTHONPATH, no PIP_* settings, no virtual environment)."""


def arm64_root() -> Path:
    """The arm64 root, or skip (fail with ``EDGEFL_REQUIRE_ARM64=1``) where this machine
    cannot run one."""
    value = os.environ.get(ROOT_ENV, "")
    root = Path(value)
    if not value:
        problem = f"{ROOT_ENV} is not set (bash .ci/arm64-root builds the root)"
    elif not (root / "usr" / "bin" / "python3").exists():
        problem = f"no arm64 root with python3 at {ROOT_ENV}={value} (bash .ci/arm64-root)"
    elif os.geteuid() != 0:
        problem = "chroot into the arm64 root needs root"
    elif shutil.which("unshare") is None:
        problem = "no unshare (util-linux)"
    elif os.uname().machine != "aarch64" and not BINFMT.is_file():
        problem = f"qemu's aarch64 interpreter is not registered ({BINFMT}): .ci/arm64-root"
    else:
        return root
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{problem}, but {REQUIRE_ENV}=1")
    pytest.skip(problem)


def in_root(root: Path, command: Sequence[str]) -> list[str]:
    """``command`` run inside ``root``: a private mount namespace with its own /proc, then
    chroot (whose current folder is the root's /), with the environment ``ENV``."""
    script = 'mount -t proc proc "$0/proc" && exec chroot "$0" /usr/bin/env -i "$@"'
    unshare = ["unshare", "--mount", "--propagation", "private"]
    return [*unshare, "sh", "-c", script, str(root), *ENV, *command]


@dataclass(frozen=True)
class Board:
    """The bundle installed in the arm64 root, in a folder of this test run's own."""

    root: Path
    inside: str  # the run's folder, as the root sees it
    python: str  # the installed client's interpreter, as the root sees it
    config_dir: str
    broker: Mosquitto
    data: Path  # the host device's data
    signing_key: Path  # the coordinator's signing key (its .pub is in the bundle)

    def path(self, inside: str) -> Path:
        """The file the root calls ``inside``, seen from here."""
        return self.root / inside.lstrip("/")

    def command(self, *args: str) -> list[str]:
        return in_root(self.root, [self.python, *args])

    def run(self, *args: str, timeout: float = 300) -> str:
        return run(self.command(*args), timeout=timeout)


BOARD_SCRATCH = "srv/edgefl-test"
"""Where a test run keeps its files inside the arm64 root (.ci/arm64-root removes leftovers)."""


@pytest.fixture(scope="module")
def board(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Board]:
    root = arm64_root()
    host = tmp_path_factory.mktemp("arm64")
    inside = f"/{BOARD_SCRATCH}-{uuid.uuid4().hex[:12]}"  # a path on the board, not here
    work = root / inside.lstrip("/")
    version = run(
        in_root(root, ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
    )
    with Mosquitto(host) as broker:
        try:
            data, template = write_fleet_files(host)
            config = host / "edgefl.toml"
            config.write_text(
                f'broker = "{broker.url}"\nfleet = "{FLEET}"\ndevice_id = "pi-arm64"\n'
                f"connect_retry = 120\n"
                f'onnx_template = "{inside}/etc/template.onnx"\n'
                f'serve_onnx = "{inside}/served/model.onnx"\n'
                f'coordinator_key_file = "{inside}/etc/coordinator.pub"\n'
            )
            bundle = host / "bundle"
            flags = ["--platform", "linux_aarch64", "--python-version", version.strip()]
            flags += ["--config", str(config), "--onnx-template", str(template)]
            flags += ["--coordinator-key", str(coordinator_public_key(host))]
            run(bundle_command(bundle, "infer", *flags), cwd=ROOT)
            shutil.copytree(bundle, work / "bundle")
            installed = run(
                in_root(
                    root,
                    [
                        "sh",
                        f"{inside}/bundle/install.sh",
                        "--prefix",
                        f"{inside}/opt",
                        "--config-dir",
                        f"{inside}/etc",
                        "--no-service",
                    ],
                ),
                timeout=900,
            )
            assert "installed; run:" in installed, installed
            yield Board(
                root=root,
                inside=inside,
                python=f"{inside}/opt/venv/bin/python",
                config_dir=f"{inside}/etc",
                broker=broker,
                data=data,
                signing_key=host / "coordinator.key",
            )
        finally:
            # commands in the root mount /proc in private namespaces: nothing is mounted
            # under work here, so this removes files of the run only
            shutil.rmtree(work, ignore_errors=True)


def test_the_board_is_aarch64_with_onnxruntime_and_no_torch(board: Board) -> None:
    probe = (
        "import importlib, json, platform\n"
        "found = {}\n"
        "for name in ('torch', 'onnxruntime', 'edge_client.serve.follower', 'edge_client.serve.infer'):\n"
        "    try:\n"
        "        importlib.import_module(name); found[name] = True\n"
        "    except ImportError:\n"
        "        found[name] = False\n"
        "print(json.dumps({'machine': platform.machine(), 'found': found}))\n"
    )
    report = json.loads(board.run("-c", probe).strip().splitlines()[-1])
    assert report["machine"] == "aarch64"
    assert report["found"] == {
        "torch": False,
        "onnxruntime": True,
        "edge_client.serve.follower": True,
        "edge_client.serve.infer": True,
    }
    # nor anywhere else on the board: its own Python has no torch either
    bare = subprocess.run(
        in_root(board.root, ["python3", "-c", "import torch"]),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bare.returncode == 1 and "No module named 'torch'" in bare.stderr, bare.stderr


@dataclass(frozen=True)
class Round:
    final: Path  # the coordinator's final model.onnx, here
    served: Path  # the follower's serve_onnx file, seen from here
    served_inside: str
    follower_exit: int
    follower_log: str


@pytest.fixture(scope="module")
def fleet_round(board: Board, tmp_path_factory: pytest.TempPathFactory) -> Round:
    """One round of the real coordinator with ``--broadcast-model``: a device here trains,
    the board's ``follow`` serves the broadcast model."""
    host = tmp_path_factory.mktemp("arm64-round")
    served_inside = f"{board.inside}/served/model.onnx"
    served = board.path(served_inside)
    follower = subprocess.Popen(
        board.command(
            "-m",
            "edge_client",
            "follow",
            "--config",
            f"{board.config_dir}/edgefl.toml",
            "--log-format",
            "journald",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    # The broadcast of this fp32 model needs two chunks, so the broker does not retain it:
    # the follower (slow to start under emulation) must be subscribed before the round.
    follower_lines: list[str] = []
    subscribed = threading.Event()

    def read_follower() -> None:
        assert follower.stderr is not None
        for line in follower.stderr:
            follower_lines.append(line)
            if "follows fleet" in line:
                subscribed.set()

    reader = threading.Thread(target=read_follower, daemon=True)
    reader.start()
    if not subscribed.wait(300):
        follower.kill()
        reader.join(10)
        pytest.fail("follow on the board did not subscribe in 300 s:\n" + "".join(follower_lines))
    shutil.copyfile(board.signing_key, host / "coordinator.key")  # the bundled key's
    provision_keys(host, "host-1")
    device = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edge_client",
            "run",
            "--broker",
            board.broker.url,
            "--fleet",
            FLEET,
            "--device-id",
            "host-1",
            "--auth-key-file",
            str(host / "host-1.key"),
            "--coordinator-key-file",
            str(coordinator_public_key(host)),
            "--data",
            str(board.data),
            "--model",
            "mlp",
            "--state-dir",
            str(host / "device"),
            "--connect-retry",
            "30",
            "--exit-when-finished",
        ],
        cwd="/",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        server = run_coordinator(board.broker.url, FLEET, host / "coordinator", host / "keys.json")
        _, device_log = device.communicate(timeout=120)
        assert server.returncode == 0, server.stderr[-3000:]
        assert "round 1/1 closed" in server.stderr, server.stderr[-3000:]
        assert device.returncode == 0, device_log[-3000:]
        deadline = time.monotonic() + 180
        while not served.with_name("model.onnx.json").is_file():
            if follower.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        follower.terminate()
        follower.wait(timeout=60)
        reader.join(timeout=10)
        follower_log = "".join(follower_lines)
    finally:
        for process in (device, follower):
            if process.poll() is None:
                process.kill()
                process.wait()
    return Round(
        final=host / "coordinator" / "final" / "model.onnx",
        served=served,
        served_inside=served_inside,
        follower_exit=follower.returncode,
        follower_log=follower_log,
    )


def infer_on_board(
    board: Board, model_inside: str, images: np.ndarray
) -> tuple[list[int], np.ndarray]:
    """Predictions (the command's JSON) and logits (its ``--logits --output``) of
    ``python -m edge_client infer`` on the board."""
    name = uuid.uuid4().hex[:8]
    batch, logits = f"{board.inside}/x-{name}.npy", f"{board.inside}/logits-{name}.npy"
    np.save(board.path(batch), images)
    out = board.run(
        "-m",
        "edge_client",
        "infer",
        "--model",
        model_inside,
        "--input",
        batch,
        "--output",
        logits,
        "--logits",
    )
    result = json.loads(out)
    assert result["batch"] == len(images)
    return result["predictions"], np.load(board.path(logits))


def test_infer_on_the_board_predicts_what_onnxruntime_here_predicts(
    board: Board, fleet_round: Round
) -> None:
    model_inside = f"{board.inside}/final.onnx"
    shutil.copyfile(fleet_round.final, board.path(model_inside))
    images = np.random.default_rng(0).random((32, 1, SIDE, SIDE), dtype=np.float32)
    predictions, logits = infer_on_board(board, model_inside, images)
    here = OnnxClassifier(fleet_round.final)
    assert predictions == here.predict(images).tolist()
    np.testing.assert_allclose(logits, here.predict_logits(images), rtol=1e-4, atol=1e-5)


def test_follow_on_the_board_serves_the_fleet_model_it_is_broadcast(
    board: Board, fleet_round: Round
) -> None:
    log = fleet_round.follower_log
    assert fleet_round.follower_exit == 0, log[-3000:]
    assert "<6>edge_client.serve.follower: round 1: served model refreshed" in log, log[-3000:]
    meta = json.loads(fleet_round.served.with_name("model.onnx.json").read_text())
    assert meta["round"] == 1
    images = np.random.default_rng(1).random((16, 1, SIDE, SIDE), dtype=np.float32)
    predictions, _ = infer_on_board(board, fleet_round.served_inside, images)
    assert predictions == OnnxClassifier(fleet_round.final).predict(images).tolist()
