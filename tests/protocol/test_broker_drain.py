"""The embedded broker delivers what it acknowledged before it shuts down.

amqtt drops what is still queued when it shuts down ("N messages not broadcasted"). In
a sim run the devices' last statuses were such messages: 20 devices, one round, lost
15 of them before EmbeddedBroker.stop drained the queue.
"""

from __future__ import annotations

import subprocess
import sys


def test_a_sim_run_through_the_embedded_broker_loses_no_message() -> None:
    # Execute: a short run whose devices publish their statuses just before the end.
    argv = ["--devices", "20", "--rounds", "1", "--local-steps", "1", "--participation", "0.1"]
    proc = subprocess.run(
        [sys.executable, "-m", "sim", *argv], capture_output=True, text=True, timeout=240
    )

    # Assert: the run succeeded and amqtt reported nothing left undelivered.
    assert proc.returncode == 0, proc.stderr
    assert "not broadcasted" not in proc.stderr
    assert "PUBACK for unknown" not in proc.stderr
