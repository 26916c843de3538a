"""Issue 17's device and broker faults, each against a real Mosquitto with the coordinator
and the edge clients as separate processes (benchmarks/fault_scenarios.py runs them; the
figures of ``python -m benchmarks.faults`` come from the same code)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.fault_scenarios import ScenarioReport, chunks, churn, cut_upload
from tests.protocol.brokers import require_mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

_SLACK_S = 2.0
"""A round may close this long after its deadline (the coordinator ticks, a loaded host)."""


def test_a_device_cut_mid_upload_is_counted_once_after_its_restart(tmp_path: Path) -> None:
    require_mosquitto()

    report = cut_upload(tmp_path)

    assert report.finished, report.problems
    ((seen, count),) = report.notes["transfer_at_kill"]  # one transfer, cut short
    assert 0 < seen < count
    assert report.rounds_completed == report.rounds == 2
    assert report.lost == 0 and report.twice == 0 and report.delayed == 0
    # the restarted device's update of round 1 was taken once (or, had round 1 closed
    # meanwhile, it would have joined round 2)
    taken = report.notes["victim_taken"]
    assert taken in ([1, 2], [2])
    # accepted once; a resend the device made before that ack reached it is answered
    # "duplicate" (also a positive ack: the update is stored), never accepted again
    acks = [(ok, reason) for r, ok, reason in report.notes["victim_acks"] if r == taken[0]]
    assert acks.count((True, "ok")) == 1, acks
    assert all(reason in ("ok", "duplicate") for ok, reason in acks if ok), acks
    assert all(c["on_time"] == 2 for c in report.notes["closes"].values()) or taken == [2]


def test_duplicated_shuffled_and_late_chunks_count_once_and_late_ones_are_refused(
    tmp_path: Path,
) -> None:
    require_mosquitto()

    report = chunks(tmp_path)

    assert report.finished, report.problems
    assert report.notes["chunks"] > 2
    assert report.notes["burst_ack"] == "ok"  # reassembled from 2 x N chunks in no order
    # the copies after the round closed: the same transfer is dropped without an answer,
    # a new transfer of the same update is acknowledged as the duplicate it is
    assert report.notes["late_copy_acks"] == [(True, "duplicate")]
    assert report.notes["crafted-0_taken"] == [1, 2]
    # an update that missed its round, sent in shuffled chunks after the close: refused
    assert report.notes["late_acks"] == [(False, "late")]
    assert report.notes["crafted-1_taken"] == [2]
    closes = report.notes["closes"]
    assert {r: (c["on_time"], c["selected"]) for r, c in closes.items()} == {1: (2, 3), 2: (3, 3)}
    assert report.lost == 0 and report.twice == 0 and report.delayed == 0
    assert report.updates_rejected == 1


@pytest.fixture(scope="module")
def churned(tmp_path_factory: pytest.TempPathFactory) -> ScenarioReport:
    """One run with a silent device, a device joining mid-run and one leaving."""
    require_mosquitto()
    return churn(tmp_path_factory.mktemp("churn"))


def test_a_device_that_never_answers_delays_rounds_only_to_their_deadline(
    churned: ScenarioReport,
) -> None:
    report = churned

    assert report.finished, report.problems
    assert report.rounds_completed == report.rounds
    assert report.notes["silent_rounds"] == list(range(1, report.rounds + 1))  # always selected
    closes = report.notes["closes"]
    left = report.notes["leaver_rounds_at_kill"][-1]  # the leaver may have died before answering
    assert all(c["on_time"] == c["selected"] - 1 for r, c in closes.items() if r != left)
    assert closes[left]["on_time"] >= closes[left]["selected"] - 2
    assert all(c["s"] <= report.notes["timeout_s"] + _SLACK_S for c in closes.values())
    assert report.notes["deadline_logs"] == report.rounds
    assert report.lost == 0 and report.twice == 0 and report.delayed == 0


def test_devices_join_and_leave_between_rounds(churned: ScenarioReport) -> None:
    report = churned

    assert report.finished, report.problems
    joined = report.notes["joiner_rounds"]
    assert joined and joined[0] > 1  # it came mid-run and was selected from then on
    assert joined == list(range(joined[0], report.rounds + 1))
    killed = report.notes["leaver_rounds_at_kill"]
    assert report.notes["leaver_rounds"] == killed  # never selected after its last will
    assert killed == list(range(1, killed[-1] + 1)) and killed[-1] < report.rounds
    sizes = [report.notes["closes"][r]["selected"] for r in range(1, report.rounds + 1)]
    assert max(sizes) == 4 and sizes[-1] == 3  # three to start, four with the joiner, three
    assert report.lost == 0 and report.twice == 0 and report.delayed == 0
