"""Error feedback across a crash: the residual of an upload encoded but not known sent is
staged with the upload it belongs to, and kept at a restart only for that very upload
(the unacknowledged update the device sends again)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edge_client.train.client_state import read_model
from edge_client.train.transfer import RESIDUAL_FILE, STAGED_FILE, TransferState
from protocol.arrays import content_fingerprint
from protocol.deltas import encode_delta
from protocol.messages import Message, Update, UploadSpec
from protocol.tensors import Precision
from protocol.tensorset import TensorSet, encode_tensors

SPEC = UploadSpec(precision=Precision.INT8, mode="delta", base="global")


def arrays(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((16, 8)).astype(np.float32), "b": rng.random(8, np.float32)}


RECEIVED = {"global": arrays(0)}


def unacked(weights: TensorSet) -> Message:
    body = Update(num_samples=10, sets={"weights": weights})
    return Message(fleet="lab", sender="dev-1", body=body)


def rounds(state: TransferState, seeds: list[int], commit_last: bool = True) -> list[TensorSet]:
    """Uploads of ``seeds``' weights, each committed (sent) but maybe the last."""
    out = []
    for i, seed in enumerate(seeds):
        out.append(state.encode_upload(arrays(seed), SPEC, RECEIVED, commit=False))
        if commit_last or i < len(seeds) - 1:
            state.commit_upload()
    return out


def test_a_residual_staged_for_the_unacknowledged_update_is_kept_at_a_restart(
    tmp_path: Path,
) -> None:
    # Prepare: one device sends rounds 1 and 2; another is killed after encoding round 2
    # and persisting it as unacknowledged, before its send was confirmed
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    steady = TransferState(tmp_path / "a", fsync=False)
    crashed = TransferState(tmp_path / "b", fsync=False)
    sent = rounds(steady, [1, 2])
    pending = rounds(crashed, [1, 2], commit_last=False)
    assert (tmp_path / "b" / STAGED_FILE).exists()
    # Execute: it restarts with round 2's update unacknowledged (it sends it again)
    restarted = TransferState(tmp_path / "b", fsync=False)
    restarted.recover(unacked(pending[-1]))
    # Assert: same uploads, same residual on disk, and round 3 is the same upload
    assert pending == sent
    assert not (tmp_path / "b" / STAGED_FILE).exists()
    a, b = read_model(tmp_path / "a" / RESIDUAL_FILE), read_model(tmp_path / "b" / RESIDUAL_FILE)
    assert a.keys() == b.keys() and {"w", "b"} <= a.keys()  # and the upload's name
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert rounds(restarted, [3]) == rounds(steady, [3])


def test_a_staged_residual_of_another_upload_is_dropped(tmp_path: Path) -> None:
    # Prepare: round 2 was encoded, but the update persisted as unacknowledged is round
    # 1's (the device was killed before round 2's was saved), or there is none
    for unacked_round in (0, None):
        state = tmp_path / f"s{unacked_round}"
        state.mkdir()
        device = TransferState(state, fsync=False)
        uploads = rounds(device, [1, 2], commit_last=False)
        residual_after_1 = read_model(state / RESIDUAL_FILE)
        # Execute
        restarted = TransferState(state, fsync=False)
        restarted.recover(None if unacked_round is None else unacked(uploads[unacked_round]))
        # Assert: the staged residual is gone, the committed one unchanged; the next
        # upload carries round 1's residual, as a device that never encoded round 2
        assert not (state / STAGED_FILE).exists()
        kept = read_model(state / RESIDUAL_FILE)
        assert all(np.array_equal(kept[k], residual_after_1[k]) for k in kept)
        twin_dir = tmp_path / f"twin{unacked_round}"
        twin_dir.mkdir()
        twin = TransferState(twin_dir, fsync=False)
        rounds(twin, [1])
        assert rounds(restarted, [3]) == rounds(twin, [3])


def test_a_full_precision_uplink_stages_nothing(tmp_path: Path) -> None:
    device = TransferState(tmp_path, fsync=False)
    full = UploadSpec(precision=Precision.FP32)
    weights = device.encode_upload(arrays(1), full, RECEIVED, commit=False)
    assert weights == encode_tensors(arrays(1))
    assert not (tmp_path / STAGED_FILE).exists() and not (tmp_path / RESIDUAL_FILE).exists()


def test_devices_that_receive_one_message_hold_one_copy_of_its_model() -> None:
    """The held model of a lossy transfer is the shared, read-only decoding of the
    message: emulated devices receiving the same message hold it once, and a delta
    against it still decodes for each."""
    sent = {"global": encode_tensors(arrays(3), Precision.INT8)}
    devices = [TransferState() for _ in range(3)]
    decoded = [d.decode(sent, ["global"]) for d in devices]
    held = [d._held for d in devices]
    assert held[0] is not None
    for other in held[1:]:
        assert other is not None
        assert all(other[k] is held[0][k] for k in held[0])
    assert all(not v.flags.writeable for v in held[0].values())
    assert devices[0].held_fingerprint == content_fingerprint(decoded[0]["global"])
    assert {d.held_fingerprint for d in devices} == {devices[0].held_fingerprint}
    # the next round: a delta against the held model, per device
    base = decoded[0]["global"]
    delta = encode_delta(arrays(4), base, devices[0].held_fingerprint or "", Precision.INT8)
    for device in devices:
        out = device.decode({"global": delta.tensors}, ["global"])
        np.testing.assert_allclose(out["global"]["w"], arrays(4)["w"], atol=0.05)
