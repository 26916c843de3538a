"""sim.progress: live tqdm bars on a terminal, one line per round elsewhere."""

from __future__ import annotations

import io

from coordinator.config import TrainingSettings
from coordinator.report import RoundRecord
from sim.progress import TerminalProgress
from sim.run import SimConfig, run_simulation
from tests.coordinator.test_report import make_report


class TTYStream(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_one_plain_line_per_round_when_not_a_tty() -> None:
    report = make_report()
    stream = io.StringIO()

    with TerminalProgress(3, stream=stream) as progress:
        for record in report.rounds:
            progress.step(f"round {record.round}/3: devices trained", total=10)
            progress.advance(10)
            progress.round_closed(record)

    text = stream.getvalue()
    lines = text.splitlines()
    assert len(lines) == 3
    assert "\r" not in text and "|#" not in text and "devices trained" not in text
    assert "round 1/3" in lines[0] and "aca 40.0%" in lines[0] and "up 1.0 kB" in lines[0]
    assert "round 2/3" in lines[1] and "aca 60.0%" in lines[1] and "oca 58.0%" in lines[1]
    assert "round 3/3" in lines[2] and "aca 81.2%" in lines[2] and "oca 80.0%" in lines[2]
    assert "up 4.5 kB down 20.0 kB" in lines[2]  # payload bytes so far
    assert "2.00 s/round" in lines[2]  # mean of 2.5, 1.5, 2.0


def test_a_terminal_gets_a_live_bar_for_the_step_and_the_round_lines_stay() -> None:
    report = make_report()
    stream = TTYStream()

    with TerminalProgress(3, stream=stream, refresh_s=0) as progress:
        progress.step("round 1/3: devices trained", total=4)
        progress.advance(3)
        live = stream.getvalue()
        progress.round_closed(report.rounds[0])

    text = stream.getvalue()
    assert "round 1/3: devices trained: 3/4" in live  # the bar counts devices
    assert "\r" in live
    assert "round 1/3 | AMP aca 40.0% | up 1.0 kB down 4.0 kB | 2.50 s/round\n" in text


def test_steps_without_a_count_show_what_is_under_way() -> None:
    stream = TTYStream()

    with TerminalProgress(1, stream=stream) as progress:
        progress.step("loading synthetic")
        shown = stream.getvalue()

    assert "loading synthetic" in shown


class Recorded:
    """A Progress that keeps what it is told."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int | None]] = []
        self.advanced: dict[str, int] = {}
        self.closed: list[int] = []

    def step(self, text: str, total: int | None = None) -> None:
        self.steps.append((text, total))
        self.advanced[text] = 0

    def advance(self, units: int = 1) -> None:
        self.advanced[self.steps[-1][0]] += units

    def round_closed(self, record: RoundRecord) -> None:
        self.closed.append(record.round)


def test_a_run_reports_its_setup_and_the_devices_trained_in_each_round() -> None:
    # Prepare: 4 devices, 3 selected per round, in process.
    config = SimConfig(
        devices=4,
        rounds=2,
        participation=0.75,
        transport="inproc",
        training=TrainingSettings(local_steps=1),
    )
    progress = Recorded()

    # Execute
    report = run_simulation(config, progress=progress)

    # Assert: the setup steps, then per round a step counting its 3 devices to the end.
    texts = [text for text, _ in progress.steps]
    assert texts[0].startswith("loading synthetic")
    assert ("connecting devices", 4) in progress.steps
    for number in (1, 2):
        step = f"round {number}/2: devices trained"
        assert (step, 3) in progress.steps
        assert progress.advanced[step] == 3
    assert progress.closed == [1, 2] == [r.round for r in report.rounds]


def test_a_long_counted_step_logs_a_line_now_and_then_when_not_a_tty() -> None:
    stream = io.StringIO()
    now = [0.0]

    with TerminalProgress(1, stream=stream, every_s=30, clock=lambda: now[0]) as progress:
        progress.step("connecting devices", total=100)
        for _ in range(100):
            now[0] += 1.0
            progress.advance()

    assert stream.getvalue().splitlines() == [
        "connecting devices: 30/100 (30 s)",
        "connecting devices: 60/100 (60 s)",
        "connecting devices: 90/100 (90 s)",
    ]
