"""The dashboard in a real browser: headless Chromium (Debian's, driven by Playwright;
no browser is ever downloaded) on the page of

* a coordinator in this process keyed for 5 ``python -m edge_client`` processes over a
  real Mosquitto: the page shows the 5 devices online, the round advancing, a SIGKILLed
  device going offline (its last will), the AMP chart gaining a point per round (the
  test evaluates each round's global model on the devices' held-out test splits and
  hands the result to the telemetry, as ``--eval-data`` does), and a hostile refusal
  text shown as text;
* a short ``python -m sim run --dashboard``: the page fills in from the lab emulator's
  own evaluations; with ``EDGEFL_SCREENSHOT=PATH`` it saves the screenshot of
  docs/dashboard.md there (``docs/img/dashboard.png``).

Skipped where /usr/bin/chromium (or Playwright) is missing, unless
``EDGEFL_REQUIRE_CHROMIUM=1`` (CI), which fails instead.
"""

from __future__ import annotations

import copy
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness import (
    edge_client_command,
    private_broker,
    processes,
    spawn,
    write_fleet,
)
from coordinator.actions import RoundClosed, RoundStarted
from coordinator.config import CoordinatorConfig, MonitorSettings, TrainingSettings
from coordinator.evaluation import evaluate_accuracy, fairness
from coordinator.monitor import monitoring
from coordinator.runtime import Coordinator, build_models
from models import load_state_arrays
from protocol.auth import Keyring
from protocol.signing import SigningKey
from protocol.transport import MqttConfig, MqttTransport
from sim.datasets import load_dataset
from sim.partition import partition_dataset
from tests.protocol.brokers import free_port, require_mosquitto

pytestmark = [pytest.mark.mosquitto, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
SEED = 0
DEVICES = 5
ROUNDS = 6
PACE_S = 1.0
"""The coordinator holds each round's start this long (an observer sleeping on the
engine thread), so the page, refreshed about once a second, sees every round."""
DEADLINE_S = 20.0
"""Each round's deadline: the last round closes at it (its killed device never answers;
every other round's updates are in within a few seconds)."""
WAIT_MS = 60_000
"""The longest one thing the page must show may take on a loaded host."""
HOSTILE = "<img src=x onerror=alert(1)>"


def require_chromium() -> Any:
    """Playwright's sync API, or skip (fail with ``EDGEFL_REQUIRE_CHROMIUM=1``)."""
    required = os.environ.get("EDGEFL_REQUIRE_CHROMIUM") == "1"
    try:
        from playwright import sync_api
    except ImportError:
        if required:
            pytest.fail("playwright is not installed but EDGEFL_REQUIRE_CHROMIUM=1")
        pytest.skip("playwright is not installed")
    if not os.access(CHROMIUM, os.X_OK):
        if required:
            pytest.fail(f"{CHROMIUM} is not installed but EDGEFL_REQUIRE_CHROMIUM=1")
        pytest.skip(f"{CHROMIUM} is not installed")
    return sync_api


@contextmanager
def browser(url: str) -> Iterator[tuple[Any, list[str]]]:
    """A headless Chromium page on ``url`` (1280x900) and the errors it logged (console
    errors, a violated CSP among them, uncaught exceptions and any dialog opened)."""
    sync_api = require_chromium()
    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"]
        )
        try:
            page = chromium.new_page(viewport={"width": 1280, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))

            def dialog(d: Any) -> None:
                errors.append(f"dialog: {d.message}")
                d.dismiss()

            page.on("dialog", dialog)
            page.set_default_timeout(WAIT_MS)
            page.goto(url)
            yield page, errors
        finally:
            chromium.close()


def shows(page: Any, selector: str) -> str:
    return str(page.locator(selector).text_content() or "")


def points(page: Any) -> int:
    return int(page.locator("#acc-chart").get_attribute("data-points") or 0)


class Evaluator:
    """Each round's global model evaluated on the devices' held-out test splits (the
    same partition :func:`~benchmarks.harness.write_fleet` wrote): AMP and WLP, percent."""

    def __init__(self, config: CoordinatorConfig) -> None:
        federation = partition_dataset(
            load_dataset("synthetic", seed=SEED), DEVICES, math.inf, seed=SEED
        )
        self.splits = [(d.test.x, d.test.y) for d in federation.devices]
        (self.group, self.template), *_ = build_models(config).items()

    def __call__(self, closed: RoundClosed) -> dict[str, dict[str, float]]:
        model = copy.deepcopy(self.template)
        load_state_arrays(model, closed.models[self.group]["aca"])
        accuracies = [evaluate_accuracy(model, x, y) for x, y in self.splits]
        fair = fairness(accuracies, [len(y) for _, y in self.splits])
        return {"aca": {"amp": fair.amp, "wlp": fair.wlp}}


def test_the_page_follows_a_fleet_of_edge_clients(tmp_path: Path) -> None:
    require_chromium()
    require_mosquitto()
    started_at = time.monotonic()
    with ExitStack() as stack:
        broker = stack.enter_context(private_broker(tmp_path, "dashboard"))
        files, keys = write_fleet(tmp_path / "fleet", DEVICES, SEED)
        devices = stack.enter_context(processes())
        config = CoordinatorConfig(
            fleet="dash", strategy="fedavg", model="mlp", rounds=ROUNDS, participation=1.0,
            min_devices=DEVICES, round_timeout_s=DEADLINE_S, silent_grace_s=2.0, seed=SEED,
            training=TrainingSettings(local_steps=2, batch_size=16),
        )  # fmt: skip
        coordinator = Coordinator(
            config,
            MqttTransport(MqttConfig.from_url(broker.url, client_id="dash-coordinator")),
            keyring=Keyring.load(keys),
            signing_key=SigningKey.load(keys.parent / "coordinator.key"),
        )
        evaluate = Evaluator(config)
        seen_five = threading.Event()
        victim = files[-1].stem
        killed = threading.Event()

        def observe(action: object) -> None:  # on the engine thread
            if isinstance(action, RoundClosed):
                coordinator.telemetry.evaluated(action.round, evaluate(action))
                if action.round == 1:
                    seen_five.wait(WAIT_MS / 1000)  # the page saw the whole fleet online
            elif isinstance(action, RoundStarted):
                if action.round == ROUNDS:  # the last: the next would wait for 5 online
                    devices[-1].kill()  # SIGKILL: its broker sends its last will
                    outcome["killed_at"] = time.monotonic()
                    killed.set()
                time.sleep(PACE_S)

        coordinator.add_observer(observe)
        (dashboard,) = stack.enter_context(
            monitoring(coordinator.telemetry, MonitorSettings(dashboard="127.0.0.1:0"))
        )
        outcome: dict[str, Any] = {}

        def serve() -> None:
            outcome["models"] = coordinator.run()
            outcome["finished_at"] = time.monotonic()

        run = threading.Thread(target=serve)
        run.start()
        stack.callback(run.join, 60)
        stack.callback(coordinator.stop)
        for path in files:
            command = edge_client_command(
                broker.url, "dash", path, tmp_path / path.stem,
                ("--model", "mlp", "--init-seed", str(SEED)),
            )  # fmt: skip
            devices.append(spawn(command, tmp_path / f"{path.stem}.log"))

        page, errors = stack.enter_context(browser(dashboard.url))
        page_at = time.monotonic()
        # the whole fleet online, in the cards and in the table
        page.wait_for_function(
            "() => document.getElementById('online').textContent === '5'"
            " && document.querySelectorAll('#devices tbody tr[data-online=\"true\"]').length === 5"
        )
        assert shows(page, "#fleet") == "dash" and shows(page, "#registered").startswith("of 5")
        seen_five.set()
        # a hostile refusal text (a forged frame on a topic naming no real device)
        forger = MqttTransport(MqttConfig.from_url(broker.url, client_id="forger"))
        forger.connect()
        forger.publish(f"fl/dash/devices/{HOSTILE}/update", b"\x00" * 40)
        forger.disconnect()

        # the run goes on: rounds advance, the chart gains a point per evaluated round
        rounds: list[int] = []
        charted: list[int] = []
        while run.is_alive() and time.monotonic() - page_at < 150:
            text = shows(page, "#round")
            if "/" in text:
                rounds.append(int(text.split("/")[0]))
            charted.append(points(page))
            time.sleep(0.2)
        run.join(60)
        assert not run.is_alive() and outcome.get("models") is not None
        # the last snapshot, after the run
        page.wait_for_function(
            f"() => document.getElementById('acc-chart').dataset.points === '{ROUNDS}'"
            " && document.getElementById('phase').textContent === 'finished'"
        )
        assert shows(page, "#round") == f"{ROUNDS} / {ROUNDS}"
        assert shows(page, "#completed").startswith(f"{ROUNDS} round")
        # the killed device went offline (its last will), and the last round did not
        # wait for it to the deadline: dropped after the silent grace
        assert killed.is_set() and outcome["finished_at"] - outcome["killed_at"] < DEADLINE_S
        page.wait_for_function(
            "() => document.getElementById('online').textContent === '4'"
            f" && document.querySelector('#devices tbody tr[data-device-id=\"{victim}\"]')"
            "?.dataset.online === 'false'"
        )
        victim_cells = page.locator(f'#devices tbody tr[data-device-id="{victim}"] td')
        assert victim_cells.nth(3).text_content() == "offline"
        # the victim answered every round but the last; the others every round (the
        # table's page is fetched again every few seconds)
        want = [str(ROUNDS)] * (DEVICES - 1) + [str(ROUNDS - 1)]
        page.wait_for_function(
            "want => JSON.stringify([...document.querySelectorAll('#devices tbody tr')]"
            ".map(r => r.children[5].textContent)) === JSON.stringify(want)",
            arg=want,
        )
        # the hostile text is shown as text, never parsed
        refusals = page.locator("#refusals")
        page.wait_for_function(
            "t => document.getElementById('refusals').textContent.includes(t)", arg=HOSTILE
        )
        assert refusals.locator("img").count() == 0
        assert errors == []
    elapsed = time.monotonic() - started_at
    # rounds advanced under the page's eyes, and the chart grew with them
    assert rounds == sorted(rounds) and len(set(rounds)) >= 3, rounds
    assert charted == sorted(charted) and len(set(charted)) >= 3, charted
    print(f"browser e2e: {elapsed:.1f} s; rounds seen {sorted(set(rounds))}, "
          f"points seen {sorted(set(charted))}")  # fmt: skip


def wait_until(what: str, ready: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def test_the_page_of_a_sim_run(tmp_path: Path) -> None:
    """``python -m sim run --dashboard``: the page fills in from the emulator's own
    evaluations (the run is interrupted once it has, as a user's Ctrl-C would)."""
    require_chromium()
    started_at = time.monotonic()
    port = free_port()
    log = tmp_path / "sim.log"
    command = [
        sys.executable, "-m", "sim", "run", "--devices", "40", "--rounds", "60",
        "--participation", "0.25", "--model", "mlp", "--dataset", "synthetic",
        "--local-steps", "20", "--transport", "inproc", "--fleet", "lab", "--poisoned", "0.1",
        "--dashboard", f"127.0.0.1:{port}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with log.open("wb") as out:
        sim = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        from tests.protocol.brokers import accepts_connections

        wait_until(
            "the dashboard",
            lambda: accepts_connections(port) or sim.poll() is not None,
            120,
        )
        assert sim.poll() is None, log.read_text(errors="replace")[-3000:]
        with browser(f"http://127.0.0.1:{port}/") as (page, errors):
            page.wait_for_function(
                "() => Number(document.getElementById('acc-chart').dataset.points) >= 12"
                " && document.querySelectorAll('#devices tbody tr').length >= 40"
            )
            assert shows(page, "#fleet") == "lab"
            assert shows(page, "#registered").startswith("of 40")
            assert "aca" in shows(page, "#latest-models")
            assert int(page.locator("#bytes-chart").get_attribute("data-points") or 0) >= 12
            # the table sorts on the server: by rounds answered, most first
            page.locator('#devices th[data-sort="rounds_answered"]').click()
            page.wait_for_function(
                "() => { const c = [...document.querySelectorAll('#devices tbody tr')]"
                ".map(r => Number(r.children[5].textContent));"
                " return c.length > 1 && c.every((v, i) => i === 0 || c[i - 1] >= v); }"
            )
            page.locator('#devices th[data-sort="device_id"]').click()  # back to ids
            page.wait_for_function(
                "() => { const ids = [...document.querySelectorAll('#devices tbody tr')]"
                ".map(r => r.dataset.deviceId);"
                " return ids.length > 1 && ids.every((v, i) => i === 0 || ids[i - 1] < v); }"
            )
            time.sleep(1.5)  # the table refetched in id order, the charts redrawn
            screenshot = os.environ.get("EDGEFL_SCREENSHOT")
            if screenshot:
                page.screenshot(path=screenshot)
                assert Path(screenshot).stat().st_size < 250_000
            assert errors == []
        assert sim.poll() is None  # still running: interrupted below, as Ctrl-C does
    finally:
        if sim.poll() is None:
            sim.send_signal(signal.SIGINT)
            try:
                sim.wait(60)
            except subprocess.TimeoutExpired:
                sim.kill()
                sim.wait(10)
    print(f"browser sim: {time.monotonic() - started_at:.1f} s")
