"""edge_client.logs: journald priorities and folding, JOURNAL_STREAM detection, text."""

from __future__ import annotations

import io
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_client.errors import ConfigError
from edge_client.logs import configure_logging, journal_priority, stream_is_journal


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def log_all_levels() -> None:
    log = logging.getLogger("edge_client.test")
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    log.critical("c")


def test_journald_lines_carry_syslog_priorities(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    out = io.StringIO()
    assert configure_logging(logging.DEBUG, fmt="journald", stream=out) == "journald"
    log_all_levels()
    assert out.getvalue().splitlines() == [
        "<7>edge_client.test: d",
        "<6>edge_client.test: i",
        "<4>edge_client.test: w",
        "<3>edge_client.test: e",
        "<2>edge_client.test: c",
    ]


def test_priorities_of_levels_in_between() -> None:
    assert journal_priority(logging.INFO + 5) == 6
    assert journal_priority(logging.ERROR + 1) == 3
    assert journal_priority(logging.CRITICAL + 10) == 2
    assert journal_priority(logging.NOTSET) == 7
    assert journal_priority(5) == 7


def test_level_filters_records() -> None:
    out = io.StringIO()
    configure_logging(logging.WARNING, fmt="journald", stream=out)
    log_all_levels()
    assert [line[:3] for line in out.getvalue().splitlines()] == ["<4>", "<3>", "<2>"]


def test_journald_folds_tracebacks_and_multiline_messages_into_one_line() -> None:
    out = io.StringIO()
    configure_logging(logging.INFO, fmt="journald", stream=out)
    log = logging.getLogger("edge_client.round")
    try:
        raise RuntimeError("broker went away\nreally")
    except RuntimeError:
        log.exception("round %d failed", 3)
    log.warning("two\nlines\r\nhere")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = lines
    assert first.startswith("<3>edge_client.round: round 3 failed | Traceback (most recent call")
    assert "test_logs.py" in first
    assert first.endswith("RuntimeError: broker went away | really")
    assert second == "<4>edge_client.round: two | lines | here"


def test_text_format(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    out = io.StringIO()
    assert configure_logging(logging.INFO, fmt="text", stream=out) == "text"
    logging.getLogger("edge_client.x").info("hello %s", "edge")
    line = out.getvalue()
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO edge_client\.x: hello edge\n", line
    )


def test_auto_picks_journald_when_journal_stream_names_the_stream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (tmp_path / "journal").open("w") as journal, (tmp_path / "other").open("w") as other:
        st = os.fstat(journal.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert stream_is_journal(journal)
        assert configure_logging(logging.INFO, stream=journal) == "journald"
        logging.getLogger("edge_client.a").warning("to the journal")
        # Another file (stderr redirected elsewhere by the unit) is not the journal.
        assert not stream_is_journal(other)
        assert configure_logging(logging.INFO, fmt="auto", stream=other) == "text"
        logging.getLogger("edge_client.a").warning("to a file")
    assert (tmp_path / "journal").read_text() == "<4>edge_client.a: to the journal\n"
    assert (tmp_path / "other").read_text().endswith(" WARNING edge_client.a: to a file\n")


@pytest.mark.parametrize("value", [None, "", "garbage", "1:x", "12", "0:0"])
def test_auto_falls_back_to_text(
    value: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if value is None:
        monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    else:
        monkeypatch.setenv("JOURNAL_STREAM", value)
    with (tmp_path / "log").open("w") as stream:
        assert configure_logging(logging.INFO, stream=stream) == "text"


def test_auto_with_a_stream_without_a_file_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", "1:2")
    assert not stream_is_journal(io.StringIO())
    assert configure_logging(logging.INFO, stream=io.StringIO()) == "text"


def test_default_stream_is_stderr_at_call_time(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(logging.INFO, fmt="journald")
    logging.getLogger("edge_client.b").info("on stderr")
    assert capsys.readouterr().err == "<6>edge_client.b: on stderr\n"


def test_configure_logging_replaces_handlers_idempotently() -> None:
    root = logging.getLogger()
    first, second = io.StringIO(), io.StringIO()
    configure_logging(logging.INFO, fmt="text", stream=first)
    configure_logging(logging.INFO, fmt="journald", stream=second)
    configure_logging(logging.INFO, fmt="journald", stream=second)
    assert len(root.handlers) == 1
    assert root.level == logging.INFO
    logging.getLogger("edge_client.c").info("once")
    assert first.getvalue() == ""
    assert second.getvalue() == "<6>edge_client.c: once\n"


def test_unknown_format_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown log format 'json'"):
        configure_logging(logging.INFO, fmt="json", stream=io.StringIO())  # type: ignore[arg-type]
