"""Sharding the fleet across torch.distributed ranks: two gloo CPU ranks, real processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sim.shard import Shard

ROOT = Path(__file__).resolve().parents[2]


def test_the_blocks_cover_every_device_once() -> None:
    for count in (1, 7, 10, 1001):
        for world in (1, 2, 3, 8):
            blocks = [list(Shard(rank, world).devices(count)) for rank in range(world)]
            flat = [i for block in blocks for i in block]
            assert flat == list(range(count))
            sizes = [len(block) for block in blocks]
            assert max(sizes) - min(sizes) <= 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


WORKER = textwrap.dedent(
    """
    import sys
    from sim.shard import RoundSync, broadcast, current_shard

    shard = current_shard()
    assert shard is not None
    url = broadcast("mqtt://leader:1883" if shard.leader else None)
    asked = []

    def answer(question):
        asked.append(question)
        return {"rank": shard.rank, "question": question, "url": url}

    sync = RoundSync(shard, answer)
    if shard.leader:
        for question in ("round 1", "round 2"):
            answers = sync.ask(question)
            assert [a["rank"] for a in answers] == [0, 1], answers
            assert all(a["question"] == question for a in answers), answers
            assert all(a["url"] == "mqtt://leader:1883" for a in answers), answers
    sync.close()
    if not shard.leader:
        assert asked == ["round 1", "round 2"], asked
    print(f"rank {shard.rank} of {shard.world}: ok", flush=True)
    """
)


def test_two_gloo_ranks_share_the_url_and_answer_every_round(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env["WORLD_SIZE"] = "2"
    env["PYTHONPATH"] = str(ROOT)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "rank 0 of 2: ok" in outputs[0] and "rank 1 of 2: ok" in outputs[1]


def test_a_run_sharded_over_two_ranks_counts_the_whole_fleet(tmp_path: Path) -> None:
    """torchrun, two gloo CPU ranks, the embedded broker on rank 0: every device of both
    ranks takes part, and the report's bytes are those of the same run in one process."""
    flags = ["--devices", "6", "--rounds", "2", "--participation", "1.0", "--local-steps", "2"]
    sharded, single = tmp_path / "sharded.json", tmp_path / "single.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-port", str(_free_port())]
    done = subprocess.run(
        [*torchrun, "-m", "sim", *flags, "--json-out", str(sharded)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rank 1: 3 devices done" in done.stderr
    alone = subprocess.run(
        [sys.executable, "-m", "sim", *flags, "--json-out", str(single)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert alone.returncode == 0, alone.stderr[-3000:]

    report, reference = (json.loads(p.read_text()) for p in (sharded, single))
    assert [r["devices"] for r in report["final"]["ranks"]] == [3, 3]
    assert [r["active_devices"] for r in report["rounds"]] == [6, 6]
    for key in ("bytes_up", "bytes_down"):
        assert report["final"][key] == pytest.approx(reference["final"][key], rel=0.01), key
