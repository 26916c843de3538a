"""The memory and CPU of a command's whole process tree, sampled from ``/proc`` (Linux).

:func:`run_measured` runs a command in a session of its own and samples, every
``SAMPLE_PERIOD_S``, the summed RSS of the command's process and every descendant
(:class:`TreeSampler`; PSS, which counts shared pages once, every ``PSS_EVERY``-th
sample), and measures the CPU the rest of the machine used meanwhile. The process tree
is killed when the command overruns its time or the caller is interrupted.
:mod:`benchmarks.vs_flower` measures both sides with it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Measured", "TreeSampler", "TreeTimeoutError", "mb", "run_measured"]

SAMPLE_PERIOD_S = 0.1
PSS_EVERY = 50
"""Read PSS at every 50th sample (5 s): ``smaps_rollup`` makes the kernel walk every
mapping, about 5 ms per Ray process here, too dear for 10 samples a second."""
HEARTBEAT_S = 15.0
OTHER_LOAD_WARNING = 0.25
"""Cores' worth of CPU the rest of the machine may use during a run before we warn."""


class TreeTimeoutError(Exception):
    """The measured command ran past its time (its process tree was killed)."""


def mb(n: int) -> str:
    """``n`` bytes as whole MB (10**6 bytes)."""
    return f"{n / 1e6:.0f} MB"


def _stat(pid: int) -> tuple[int, int, int, int] | None:
    """(ppid, start time, RSS pages, CPU ticks) of ``pid`` from ``/proc/PID/stat``;
    None if it is gone. (os.open / os.read: a scan of every process costs about 2 ms of
    CPU on the reference machine, 2 % of a core at 10 samples a second.)"""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    rest = raw[raw.rindex(b")") + 2 :].split()  # rest[0] is field 3 (state)
    return int(rest[1]), int(rest[19]), int(rest[21]), int(rest[11]) + int(rest[12])


def _busy_ticks() -> int:
    """CPU ticks the whole machine has spent busy (``/proc/stat``'s first line)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return user + nice + system + irq + softirq + steal


def _pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class TreeSampler:
    """Samples the summed RSS (and, less often, PSS) of a process and all its
    descendants from ``/proc``. A process stays counted after its parent exits (it is
    re-parented to init): known processes are tracked by (pid, start time)."""

    def __init__(self, root: int, period: float = SAMPLE_PERIOD_S) -> None:
        self.root = root
        self.period = period
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.known: dict[int, int] = {}  # pid -> start time
        self.cpu_ticks: dict[tuple[int, int], int] = {}  # (pid, start) -> last seen ticks
        self.peak_rss = 0
        self.peak_pss = 0
        self.peak_processes = 0
        self.current_rss = 0
        self.current_processes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tree-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def alive(self) -> list[int]:
        """The tracked processes that still exist (the root excluded once it exits)."""
        return [pid for pid, start in self.known.items() if (s := _stat(pid)) and s[1] == start]

    def sample(self) -> None:
        stats: dict[int, tuple[int, int, int, int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (s := _stat(int(entry))) is not None:
                stats[int(entry)] = s
        if self.root in stats:
            self.known.setdefault(self.root, stats[self.root][1])
        members = {
            pid for pid, start in self.known.items() if pid in stats and stats[pid][1] == start
        }
        grew = True
        while grew:  # add children of members until no more appear
            grew = False
            for pid, (ppid, start, _, _) in stats.items():
                if ppid in members and pid not in members:
                    members.add(pid)
                    self.known[pid] = start
                    grew = True
        rss = sum(stats[pid][2] for pid in members) * self.page
        for pid in members:
            self.cpu_ticks[pid, stats[pid][1]] = stats[pid][3]
        self.current_rss, self.current_processes = rss, len(members)
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_processes = max(self.peak_processes, len(members))
        if self.samples % PSS_EVERY == 0:
            self.peak_pss = max(self.peak_pss, sum(_pss_bytes(pid) for pid in members))
        self.samples += 1

    @property
    def tree_cpu_ticks(self) -> int:
        """CPU ticks of the tree's processes as last sampled (a process that ended
        between two samples loses at most one period's worth)."""
        return sum(self.cpu_ticks.values())

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.period)


@dataclass
class Measured:
    seconds: float
    returncode: int
    peak_rss: int
    peak_pss: int
    peak_processes: int
    leftover_processes: int
    other_cpu_cores: float
    log: Path


def run_measured(
    label: str,
    command: Sequence[str],
    log: Path,
    env: dict[str, str],
    timeout: float,
    *,
    cwd: Path,
    progress: Callable[[str], None],
) -> Measured:
    """Run ``command`` in ``cwd`` (a new session, output to ``log``), sampling its
    process tree; seconds from start to the exit of the command's own process. Progress
    (a heartbeat every ``HEARTBEAT_S``, warnings) goes to ``progress``.

    Raises:
        TreeTimeoutError: the command still ran after ``timeout`` s (its tree was killed).
    """
    progress(f"{label}: {shlex.join(command)}")
    with log.open("wb") as out:
        busy_before = _busy_ticks()
        started = time.perf_counter()
        child = subprocess.Popen(
            command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        sampler = TreeSampler(child.pid)
        sampler.start()
        next_beat = started + HEARTBEAT_S
        try:
            while child.poll() is None:
                now = time.perf_counter()
                if now - started > timeout:
                    _kill_tree(child.pid, sampler)
                    raise TreeTimeoutError(
                        f"{label}: still running after {timeout:.0f} s; see {log}"
                    )
                if now >= next_beat:
                    progress(
                        f"{label}: {now - started:.0f} s, {sampler.current_processes} processes,"
                        f" tree RSS {mb(sampler.current_rss)} (peak {mb(sampler.peak_rss)})"
                    )
                    next_beat += HEARTBEAT_S
                time.sleep(0.05)
            seconds = time.perf_counter() - started
        except BaseException:
            _kill_tree(child.pid, sampler)
            raise
        busy = _busy_ticks() - busy_before
        leftovers = _reap_leftovers(child.pid, sampler, progress)
        sampler.stop()
    # What the rest of the machine ran meanwhile (other users, the sampler itself), in
    # cores on average: the timings are only comparable when it is near 0.
    other = max(0.0, (busy - sampler.tree_cpu_ticks) / os.sysconf("SC_CLK_TCK") / seconds)
    if other > OTHER_LOAD_WARNING:
        progress(f"{label}: other processes kept {other:.2f} cores busy meanwhile")
    return Measured(
        seconds=seconds,
        returncode=child.returncode,
        peak_rss=sampler.peak_rss,
        peak_pss=sampler.peak_pss,
        peak_processes=sampler.peak_processes,
        leftover_processes=leftovers,
        other_cpu_cores=other,
        log=log,
    )


def _reap_leftovers(
    root: int, sampler: TreeSampler, progress: Callable[[str], None], grace: float = 15.0
) -> int:
    """Wait up to ``grace`` s for the tree's other processes to end; kill what remains.
    Returns how many were still there when the command's process exited."""
    left = [pid for pid in sampler.alive() if pid != root]
    deadline = time.perf_counter() + grace
    while left and time.perf_counter() < deadline:
        sampler.sample()  # they still count towards the peak
        time.sleep(0.2)
        left = [pid for pid in sampler.alive() if pid != root]
    if left:
        progress(f"{len(left)} processes of the tree outlived it by {grace:.0f} s; killing them")
        _kill_tree(root, sampler)
    return len(left)


def _kill_tree(root: int, sampler: TreeSampler) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(root, signal.SIGKILL)  # the session (= group) the command was started in
    for pid in sampler.alive():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
