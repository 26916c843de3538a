"""``python -m sim``'s output paths are checked before the run, and Ctrl-C stops a run
cleanly with the report of the rounds it finished."""

from __future__ import annotations

import csv
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.config import TrainingSettings
from coordinator.errors import ConfigError
from coordinator.output_paths import check_file, check_folder
from coordinator.report import RoundRecord
from sim.__main__ import main
from sim.run import RunInterrupted, SimConfig, run_simulation

TINY = ("--devices", "4", "--participation", "0.5", "--model", "mlp", "--local-steps", "2")
"""The fastest fleet of the sim's CLI tests: a round takes a fraction of a second."""


def _bad_outputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """Flags naming paths a run cannot write, and the start of the error they give."""
    afile = tmp / "afile"
    afile.write_text("not a folder")
    folder = tmp / "folder"
    folder.mkdir()
    report = tmp / "report"
    (report / "rounds.csv").mkdir(parents=True)
    return {
        "json under a file": (
            ["--json-out", str(afile / "run.json")],
            f"--json-out {afile / 'run.json'}: {afile} is a file, not a folder",
        ),
        "json deep under a file": (
            ["--json-out", str(afile / "a" / "b" / "run.json")],
            f"--json-out {afile / 'a' / 'b' / 'run.json'}: {afile} is a file",
        ),
        "json is a folder": (["--json-out", str(folder)], f"--json-out {folder}: is a folder"),
        "report dir is a file": (["--report-dir", str(afile)], f"--report-dir {afile}: is a file"),
        "report file is a folder": (
            ["--report-dir", str(report)],
            f"--report-dir {report}: {report / 'rounds.csv'} is a folder",
        ),
        "models under a file": (
            ["--save-models", str(afile / "models")],
            f"--save-models {afile / 'models'}: {afile} is a file",
        ),
        "state dir is a file": (["--state-dir", str(afile)], f"--state-dir {afile}: is a file"),
        "one path for two outputs": (
            ["--json-out", str(tmp / "x"), "--report-dir", str(tmp / "x")],
            f"--json-out and --report-dir name the same path: {tmp / 'x'}",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "json under a file",
        "json deep under a file",
        "json is a folder",
        "report dir is a file",
        "report file is a folder",
        "models under a file",
        "state dir is a file",
        "one path for two outputs",
    ],
)
def test_an_output_path_the_run_cannot_write_fails_at_once_in_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags, expected = _bad_outputs(tmp_path)[case]
    start = time.monotonic()

    code = main([*TINY, "--rounds", "50", "--transport", "inproc", *flags])

    elapsed = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"python -m sim run: error: {expected}"), err
    assert err.count("\n") == 1  # one line: no banner, no round, nothing trained
    assert elapsed < 5  # 50 rounds would take far longer


def test_the_issues_case_exits_2_before_any_training(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")

    proc = subprocess.run(
        [sys.executable, "-m", "sim", *TINY, "--rounds", "50", "--json-out", "afile/run.json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )

    assert proc.returncode == 2
    assert proc.stderr == (
        "python -m sim run: error: --json-out afile/run.json: afile is a file, not a folder\n"
    )


def test_the_devices_command_checks_its_json_out_before_connecting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    flags = ["--broker", "mqtt://127.0.0.1:1", "--fleet", "lab"]  # nothing listens there
    keys = ["--device-keys", str(tmp_path / "k.json"), "--coordinator-key-file", str(afile)]

    code = main(["devices", *flags, *keys, "--json-out", str(afile / "devices.json")])

    assert code == 2
    assert capsys.readouterr().err == (
        f"python -m sim devices: error: --json-out {afile / 'devices.json'}: "
        f"{afile} is a file, not a folder\n"
    )


def test_checks_create_nothing_and_leave_nothing_behind(tmp_path: Path) -> None:
    check_file("--json-out", tmp_path / "new" / "deeper" / "run.json")
    check_folder("--report-dir", tmp_path / "report", ("rounds.csv",))
    (tmp_path / "existing").mkdir()
    check_folder("--report-dir", tmp_path / "existing")
    (tmp_path / "run.json").write_text("{}")
    check_file("--json-out", tmp_path / "run.json")  # an earlier report is replaced

    assert sorted(p.name for p in tmp_path.rglob("*")) == ["existing", "run.json"]


@pytest.mark.skipif(os.geteuid() == 0, reason="the superuser writes into read-only folders")
def test_a_read_only_folder_is_refused(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match=r"cannot write in .*locked: permission denied"):
            check_file("--json-out", locked / "run.json")
        with pytest.raises(ConfigError, match=r"cannot write in .*locked"):
            check_folder("--report-dir", locked / "report")
    finally:
        locked.chmod(0o700)


def _lines(stream: queue.Queue[str | None], pattern: str, timeout: float) -> list[str]:
    """Lines read until one starts with ``pattern`` (it included)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        line = stream.get(timeout=max(0.0, deadline - time.monotonic()))
        if line is None:
            pytest.fail(f"the run ended before {pattern!r}: {''.join(seen)}")
        seen.append(line)
        if line.startswith(pattern):
            return seen


@pytest.fixture
def default_ctrl_c() -> Iterator[None]:
    """Ctrl-C as a user's shell leaves it (Python's KeyboardInterrupt), for this process
    and the children it starts: a shell starts a background command with SIGINT
    ignored (as CI's runs are started), and an ignored SIGINT is inherited across exec,
    so pytest and every child would ignore the tests' Ctrl-C."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("default_ctrl_c")
@pytest.mark.parametrize("transport", ["inproc", "mqtt"])
def test_ctrl_c_stops_the_run_and_writes_the_finished_rounds(
    transport: str, tmp_path: Path
) -> None:
    out, report_dir = tmp_path / "run.json", tmp_path / "report"
    argv = [*TINY, "--rounds", "500", "--transport", transport]
    outputs = ["--json-out", str(out), "--report-dir", str(report_dir)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sim", *argv, *outputs],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        before = _lines(lines, "round 1/500", timeout=60)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    finally:
        proc.kill()
    reader.join(timeout=10)
    after = []
    while (line := lines.get_nowait()) is not None:
        after.append(line)
    stderr = "".join(before + after)

    assert code == 130, stderr
    assert "Traceback" not in stderr
    data = json.loads(out.read_text())
    done = len(data["rounds"])
    assert done >= 1 and data["final"]["rounds"] == done
    assert data["final"]["interrupted"] is True
    assert [r["round"] for r in data["rounds"]] == list(range(1, done + 1))
    assert data["final"]["bytes_up"] == sum(r["bytes_up"] for r in data["rounds"])
    s = "" if done == 1 else "s"
    assert f"interrupted after {done} round{s}; writing the report of the finished rounds\n" in (
        after
    )
    with (report_dir / "rounds.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == done
    assert not any(line.startswith("done:") for line in after)


class _InterruptAfterRound:
    """A progress that presses Ctrl-C (SIGINT to the main thread) once a round closed."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.closed = 0

    def step(self, text: str, total: int | None = None) -> None:
        pass

    def advance(self, units: int = 1) -> None:
        pass

    def round_closed(self, record: RoundRecord) -> None:
        self.closed += 1
        if self.closed == self.after:
            main_thread = threading.main_thread().ident
            assert main_thread is not None
            signal.pthread_kill(main_thread, signal.SIGINT)


@pytest.mark.usefixtures("default_ctrl_c")
def test_run_simulation_raises_run_interrupted_holding_the_finished_rounds() -> None:
    config = SimConfig(
        devices=4,
        rounds=200,
        participation=0.5,
        model="mlp",
        transport="inproc",
        training=TrainingSettings(local_epochs=1, local_steps=2, batch_size=16),
    )
    start = time.monotonic()

    with pytest.raises(RunInterrupted) as interrupted:
        run_simulation(config, progress=_InterruptAfterRound(2))

    report = interrupted.value.report
    assert isinstance(interrupted.value, KeyboardInterrupt)  # uncaught, it interrupts
    assert 2 <= len(report.rounds) < 200 and report.final["rounds"] == len(report.rounds)
    assert report.final["interrupted"] is True
    left = [t.name for t in threading.enumerate() if t.name.startswith(("sim-", "fleet-"))]
    assert left == []  # the coordinator's, the evaluator's and the devices' threads ended
    assert time.monotonic() - start < 30
