"""Issue 17, part 3: a full disk or an unwritable state directory at the final save.

A finished run's state directory is made by the engine-only reference run of
test_crash (3 devices, 3 rounds, fedavg_oca). Resuming it saves the final models, as the
end of a live run does (the same ``Finished`` action). Faults are real: a file where a
folder must go, and a file-size limit (``RLIMIT_FSIZE``, with SIGXFSZ ignored so writes
fail with EFBIG) in a coordinator subprocess, which is what a full disk looks like to it.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.errors import StoreError
from coordinator.runtime import Coordinator
from coordinator.store import FileStore
from protocol.transport import MemoryBroker, MemoryTransport
from tests.coordinator.helpers import config
from tests.coordinator.test_crash import ROUNDS, reference
from tests.protocol.brokers import Mosquitto

FINAL_FILES = {"aca.pt", "oca.pt", "model.pt"}


def finished_run(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    reference(state)
    return state


def run_config(state: Path, **overrides: Any) -> CoordinatorConfig:
    return config(
        strategy="fedavg_oca",
        rounds=ROUNDS,
        min_devices=3,
        state_dir=state,
        resume=True,
        export_onnx=False,
        **overrides,
    )


def resume_in_process(state: Path) -> object:
    coordinator = Coordinator(
        run_config(state), MemoryTransport(MemoryBroker(), "coordinator"), FileStore(state)
    )
    return coordinator.run()


def test_no_empty_round_folders_are_left(tmp_path: Path) -> None:
    state = finished_run(tmp_path)
    empty = [p for p in state.rglob("*") if p.is_dir() and not any(p.iterdir())]
    assert empty == []
    rounds = sorted(p.name for p in (state / "models").iterdir())
    assert rounds == [f"r{ROUNDS + 1:06d}"]  # only the round the final models are of


def test_file_store_delete_removes_emptied_folders_only(tmp_path: Path) -> None:
    store = FileStore(tmp_path, fsync=False)
    store.write("models/r000001/g/aca", {})
    store.write("models/r000001/g/oca", {})
    store.write("models/r000002/g/aca", {})
    store.delete("models/r000001/g/aca")
    assert (tmp_path / "models" / "r000001" / "g").is_dir()
    store.delete("models/r000001/g/oca")
    assert not (tmp_path / "models" / "r000001").exists()
    assert (tmp_path / "models" / "r000002" / "g").is_dir()
    store.delete("models/r000002/g/aca")
    assert not (tmp_path / "models").exists() and tmp_path.is_dir()
    store.write("models/r000003/g/aca", {})  # folders come back as needed
    assert store.keys("models") == ["models/r000003/g/aca"]


def test_an_unwritable_final_model_fails_the_run_and_resuming_saves_them(
    tmp_path: Path,
) -> None:
    state = finished_run(tmp_path)
    blocker = state / "final" / "oca.pt"
    blocker.mkdir(parents=True)  # a folder where a model must go: that write fails
    (blocker / "keep").write_text("x")

    with pytest.raises(StoreError, match=r"could not save the final models .*oca\.pt"):
        resume_in_process(state)
    assert not list((state / "final").glob(".tmp-*"))

    (blocker / "keep").unlink()
    blocker.rmdir()
    models = resume_in_process(state)
    assert models is not None
    assert {p.name for p in (state / "final").iterdir()} == FINAL_FILES


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    with Mosquitto(tmp_path_factory.mktemp("mosquitto")) as mosquitto:
        yield mosquitto


def coordinator_process(
    state: Path, broker: Mosquitto, max_file_bytes: int | None
) -> tuple[int, str]:
    """``coordinator.__main__.run`` (the CLI's exit codes and error line) in a subprocess
    whose files cannot grow past ``max_file_bytes``."""
    script = textwrap.dedent(
        f"""
        import logging, sys
        from pathlib import Path
        from coordinator.__main__ import run
        from tests.coordinator.test_disk_full import run_config
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        cfg = run_config(Path({str(state)!r}), broker={{"url": {broker.url!r}}})
        sys.exit(run(cfg))
        """
    )

    def limit() -> None:
        if max_file_bytes is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # stays ignored across exec
            resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
        cwd=Path(__file__).parents[2],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return done.returncode, done.stderr


@pytest.mark.mosquitto
def test_a_full_disk_at_the_final_save_exits_1_with_one_line_then_resume_saves(
    tmp_path: Path, broker: Mosquitto
) -> None:
    state = finished_run(tmp_path)

    code, stderr = coordinator_process(state, broker, max_file_bytes=2048)

    assert code == 1, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "coordinator: error: could not save the final" in errors[0], stderr
    assert "--resume" in errors[0] and "File too large" in errors[0]
    assert not list((state / "final").glob("*.pt"))  # nothing half-written is left

    code, stderr = coordinator_process(state, broker, max_file_bytes=None)
    assert code == 0, stderr
    assert {p.name for p in (state / "final").iterdir()} == FINAL_FILES


@pytest.mark.mosquitto
def test_starting_with_resume_on_a_full_disk_exits_1_with_one_line(
    tmp_path: Path, broker: Mosquitto
) -> None:
    state = tmp_path / "state"
    state.mkdir()  # holds no run yet: --resume starts one, and its first write fails

    code, stderr = coordinator_process(state, broker, max_file_bytes=0)

    assert code == 1, stderr
    assert "Traceback" not in stderr
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "coordinator: error: cannot write" in errors[0], stderr
