"""The abuse benchmark's log reader: refusal lines between fences are counted, and an
honest device's own update answered as a duplicate (its retry after a late ack, as on a
loaded machine) is not a refusal of the burst."""

from __future__ import annotations

from pathlib import Path

from benchmarks.abuse import LogReader
from benchmarks.hostile import FENCE

HONEST_ID = "ab" * 16
FORGED_ID = "cd" * 16


class Running:
    """A coordinator process that has not exited."""

    def poll(self) -> None:
        return None


DUPLICATE = "for round 4: a duplicate, already stored"


def line(level: str, text: str) -> str:
    return f"2026-11-27 20:00:00,000 {level} coordinator.engine: {text}\n"


def test_refusals_between_fences_and_honest_retries_apart(tmp_path: Path) -> None:
    log = tmp_path / "coordinator.log"
    log.write_text(
        line("WARNING", "refused hello of intruder-3: unknown device")
        + line("DEBUG", f"ignored update {HONEST_ID} of dev-0 {DUPLICATE}")
        + line("DEBUG", f"ignored update {FORGED_ID} of dev-1 {DUPLICATE}")
        + line("INFO", "round 4 closed")
        + line("WARNING", f"rejected update of rogue-0 for round {FENCE + 1}: unknown device")
        + line("WARNING", "dropped bad payload on fl/x/devices/a/update: truncated")
    )
    reader = LogReader(log, lambda message_id: message_id == HONEST_ID)

    total, warned, seen = reader.until_fence(1, Running(), timeout=1.0)

    assert (total, warned, seen) == (2, 1, True)  # the forged duplicate counts, the retry not
    assert reader.honest_retries == 1
    total, warned, seen = reader.until_fence(2, Running(), timeout=0.0)
    assert (total, warned, seen) == (1, 1, False)  # the line after the fence is the next burst's
