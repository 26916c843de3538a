"""Peak RSS and start-up time of the device clients: training, follow and infer.

Starts an embedded broker, a ``python -m coordinator`` process (LeNet-5, one round, one
device, ``--broadcast-model``) and, as separate processes:

- the training client (``python -m edge_client run``): start-up is the time from launch
  to its ``online`` log line (imports, model, memory check, connection, hello); the
  round is until it exits after the run finished;
- the inference-only client (``python -m edge_client follow``) serving an fp32 and an
  int8 template: start-up to its ``follows fleet`` line, then until it has written the
  broadcast model; stopped with SIGTERM;
- ``python -m edge_client infer`` on a batch of 64 images with each served model.

Peak RSS is each process's ``VmHWM``, sampled every 5 ms while it runs (its
``ru_maxrss`` would count this process's memory at the fork). Pass the interpreters of
installed bundles (``--train-python``, ``--infer-python``) to measure exactly what a
device runs; the default is this interpreter. Data: synthetic 28x28 images (600 per
device), or a MNIST device split with ``--data-dir``.

Run from the repository root: ``python -m benchmarks.device_footprint [--data-dir DIR]
[--train-python PY] [--infer-python PY] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FLEET = "footprint"


@dataclass
class Watched:
    """A process whose stderr lines are timestamped as they come."""

    process: subprocess.Popen[str]
    started: float
    lines: list[tuple[float, str]] = field(default_factory=list)
    peak_kb: int = 0  # VmHWM sampled while it runs

    def wait_for(self, needle: str, timeout: float) -> float:
        """Seconds from launch to the first line containing ``needle``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for stamp, line in list(self.lines):
                if needle in line:
                    return stamp - self.started
            if self.process.returncode is not None:
                break
            time.sleep(0.01)
        tail = "".join(line for _, line in self.lines[-30:])
        raise RuntimeError(f"{needle!r} not seen in {timeout} s:\n{tail}")

    def reap(self, timeout: float) -> int:
        """Wait for the exit; return the exit code."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise RuntimeError(f"{self.process.args!r} did not exit in {timeout} s") from None

    @property
    def peak_rss_mb(self) -> float:
        return self.peak_kb / 1024


def launch(command: list[str]) -> Watched:
    """Run ``command`` outside the checkout; this interpreter gets the checkout on its
    path, a bundle's interpreter only what its environment installed."""
    env = dict(os.environ)
    if command[0] == sys.executable:
        env["PYTHONPATH"] = str(ROOT)
    process = subprocess.Popen(
        command, cwd="/", env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    watched = Watched(process, time.monotonic())

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            watched.lines.append((time.monotonic(), line))

    def sample() -> None:  # VmHWM: ru_maxrss would count this process's memory at fork
        status = Path(f"/proc/{process.pid}/status")
        while process.returncode is None:
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        watched.peak_kb = max(watched.peak_kb, int(line.split()[1]))
            except (OSError, ValueError):
                pass
            time.sleep(0.005)

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=sample, daemon=True).start()
    return watched


def device_file(root: Path, data_dir: Path | None) -> Path:
    from protocol.auth import Keyring, new_key, write_key_file
    from sim.datasets import load_dataset
    from sim.partition import partition_dataset, save_device_file
    from sim.synthetic import make_synthetic

    if data_dir is None:
        splits = make_synthetic(train_samples=600, test_samples=100, image_size=28)
    else:
        splits = load_dataset("mnist", data_dir=data_dir)
    devices = 1 if data_dir is None else 100  # a MNIST device holds 1 % of it
    split = partition_dataset(splits, devices, float("inf"), seed=0).devices[0]
    path = root / "dev-000.npz"
    save_device_file(path, split)
    key = new_key()  # the device's message key (device.key) and the coordinator's keyring
    write_key_file(root / "device.key", key)
    Keyring({split.device_id: key}).save(root / "keys.json")
    return path


def templates(root: Path) -> dict[str, Path]:
    import torch

    from models import build_classifier
    from models.onnx_template import export_template

    torch.manual_seed(0)
    model = build_classifier("lenet5")
    out = {}
    for precision in ("fp32", "int8"):
        path = root / f"template-{precision}.onnx"
        path.write_bytes(
            export_template(model, model.input_shape, precision=precision, model_name="lenet5")
        )
        out[precision] = path
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from protocol.signing import SigningKey
    from protocol.transport import EmbeddedBroker

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="edgefl-footprint-") as tmp, EmbeddedBroker() as b:
        root = Path(tmp)
        data = device_file(root, args.data_dir)
        made = templates(root)
        SigningKey.generate().save(root / "coordinator.key")  # and coordinator.key.pub
        connection = ["--broker", b.url, "--fleet", FLEET, "--connect-retry", "30"]
        connection += ["--coordinator-key-file", str(root / "coordinator.key.pub")]
        followers = {
            precision: launch(
                [
                    args.infer_python,
                    "-m",
                    "edge_client",
                    "follow",
                    *connection,
                    "--device-id",
                    f"cam-{precision}",
                    "--serve-onnx",
                    str(root / f"served-{precision}.onnx"),
                    "--onnx-template",
                    str(made[precision]),
                ]
            )
            for precision in made
        }
        for watched in followers.values():
            watched.wait_for("follows fleet", 120)
        trainer = launch(
            [
                args.train_python,
                "-m",
                "edge_client",
                *connection,
                "--data",
                str(data),
                "--state-dir",
                str(root / "state"),
                "--auth-key-file",
                str(root / "device.key"),
                "--exit-when-finished",
            ]
        )
        trainer_online = trainer.wait_for("online in fleet", 120)
        coordinator = subprocess.run(
            [
                sys.executable,
                "-m",
                "coordinator",
                *connection[:4],
                "--signing-key-file",
                str(root / "coordinator.key"),
                "--rounds",
                "1",
                "--min-devices",
                "1",
                "--participation",
                "1",
                "--local-epochs",
                "1",
                "--broadcast-model",
                "--no-onnx",
                "--device-keys",
                str(root / "keys.json"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if coordinator.returncode != 0:
            raise RuntimeError(f"coordinator failed:\n{coordinator.stderr[-3000:]}")
        if trainer.reap(300) != 0:
            raise RuntimeError("".join(line for _, line in trainer.lines[-30:]))
        results["train"] = {
            "startup_s": trainer_online,
            "round_s": trainer.wait_for("stopped after", 1) - trainer_online,
            "peak_rss_mb": trainer.peak_rss_mb,
        }
        for precision, watched in followers.items():
            refreshed = watched.wait_for("served model refreshed", 60)
            watched.process.send_signal(signal.SIGTERM)
            if watched.reap(60) != 0:
                raise RuntimeError("".join(line for _, line in watched.lines[-30:]))
            results[f"follow_{precision}"] = {
                "startup_s": watched.wait_for("follows fleet", 1),
                "refreshed_after_s": refreshed,
                "peak_rss_mb": watched.peak_rss_mb,
            }
        images = root / "x.npy"
        np.save(images, np.random.default_rng(0).random((64, 1, 28, 28), dtype=np.float32))
        for precision in made:
            watched = launch(
                [
                    args.infer_python,
                    "-m",
                    "edge_client",
                    "infer",
                    "--model",
                    str(root / f"served-{precision}.onnx"),
                    "--input",
                    str(images),
                ]
            )
            if watched.reap(120) != 0:
                raise RuntimeError("".join(line for _, line in watched.lines[-30:]))
            results[f"infer_{precision}"] = {
                "startup_s": time.monotonic() - watched.started,  # the whole command
                "peak_rss_mb": watched.peak_rss_mb,
            }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", type=Path, help="MNIST files (default: synthetic data)")
    parser.add_argument("--train-python", default=sys.executable, help="training interpreter")
    parser.add_argument("--infer-python", default=sys.executable, help="inference interpreter")
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    results = measure(args)
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    print("| client | start-up s | peak RSS MB | notes |")
    print("| --- | --- | --- | --- |")
    train = results["train"]
    print(
        f"| training (run, LeNet-5) | {train['startup_s']:.2f} | {train['peak_rss_mb']:.0f} "
        f"| one round (1 epoch) took {train['round_s']:.1f} s after start-up |"
    )
    for precision in ("fp32", "int8"):
        follow = results[f"follow_{precision}"]
        print(
            f"| inference-only (follow, {precision}) | {follow['startup_s']:.2f} | "
            f"{follow['peak_rss_mb']:.0f} | model refreshed after the round |"
        )
    for precision in ("fp32", "int8"):
        infer = results[f"infer_{precision}"]
        print(
            f"| infer command ({precision}, batch 64) | {infer['startup_s']:.2f} | "
            f"{infer['peak_rss_mb']:.0f} | whole command |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
