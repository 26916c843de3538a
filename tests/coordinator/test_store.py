"""Contract tests of the state store: one suite, run against FileStore and MemoryStore."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.errors import StoreError
from coordinator.store import FileStore, MemoryStore, Store


class StoreContract:
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        raise NotImplementedError

    def test_missing_key_reads_none(self, store: Store) -> None:
        assert store.read("nothing/here") is None
        assert store.read_meta("nothing") is None

    def test_round_trip_meta_and_arrays(self, store: Store) -> None:
        arrays = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array([7], np.int64)}

        store.write("updates/dev-1/r000001", {"round": 1, "ok": True, "m": {"a": 0.5}}, arrays)
        record = store.read("updates/dev-1/r000001")

        assert record is not None
        assert record.meta == {"round": 1, "ok": True, "m": {"a": 0.5}}
        assert record.arrays.keys() == arrays.keys()
        for name, array in arrays.items():
            np.testing.assert_array_equal(record.arrays[name], array)
            assert record.arrays[name].dtype == array.dtype

    def test_write_replaces_whole_record(self, store: Store) -> None:
        store.write("k", {"v": 1}, {"a": np.zeros(3, np.float32)})
        store.write("k", {"v": 2})

        record = store.read("k")

        assert record is not None and record.meta == {"v": 2} and record.arrays == {}

    def test_records_are_copies(self, store: Store) -> None:
        source = np.zeros(3, np.float32)
        store.write("k", {}, {"a": source})
        source[0] = 5
        first = store.read("k")
        assert first is not None
        first.arrays["a"][1] = 9

        again = store.read("k")

        assert again is not None and again.arrays["a"].tolist() == [0, 0, 0]

    def test_keys_by_prefix_sorted(self, store: Store) -> None:
        for key in ("run", "updates/b/r000002", "updates/a/r000001", "models/r000001/aca"):
            store.write(key, {})

        assert store.keys("updates") == ["updates/a/r000001", "updates/b/r000002"]
        assert store.keys() == [
            "models/r000001/aca",
            "run",
            "updates/a/r000001",
            "updates/b/r000002",
        ]
        assert store.keys("missing") == []

    def test_exists_tells_stored_keys(self, store: Store) -> None:
        store.write("updates/a/r000001", {}, {"w": np.zeros(2, np.float32)})

        assert store.exists("updates/a/r000001")
        assert not store.exists("updates/a/r000002")

    def test_delete_is_idempotent(self, store: Store) -> None:
        store.write("a/b", {})
        store.delete("a/b")
        store.delete("a/b")

        assert store.read("a/b") is None and store.keys() == []

    @pytest.mark.parametrize("key", ["", "/a", "a//b", "../x", "a/.hidden", "a b", "x.npz", "a/+"])
    def test_bad_keys_are_refused(self, store: Store, key: str) -> None:
        with pytest.raises(StoreError):
            store.write(key, {})

    def test_non_json_meta_and_object_arrays_are_refused(self, store: Store) -> None:
        with pytest.raises(StoreError):
            store.write("k", {"x": float("nan")})
        with pytest.raises(StoreError):
            store.write("k", {"x": object()})
        with pytest.raises(StoreError):
            store.write("k", {}, {"a": np.array([object()], dtype=object)})
        assert store.read("k") is None


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return MemoryStore()


class TestFileStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Store:
        return FileStore(tmp_path / "state")

    def test_survives_reopening(self, tmp_path: Path) -> None:
        FileStore(tmp_path).write("run", {"round": 4}, {"s": np.ones(2)})

        record = FileStore(tmp_path).read("run")

        assert record is not None and record.meta == {"round": 4}

    def test_leftover_temporary_file_is_ignored_and_removed(self, tmp_path: Path) -> None:
        store = FileStore(tmp_path)
        store.write("run", {"round": 1})
        (tmp_path / ".tmp-run.npz").write_bytes(b"half a write")

        reopened = FileStore(tmp_path)

        assert reopened.read_meta("run") == {"round": 1}
        assert not (tmp_path / ".tmp-run.npz").exists()
        assert reopened.keys() == ["run"]

    def test_corrupt_file_raises_store_error(self, tmp_path: Path) -> None:
        store = FileStore(tmp_path)
        (tmp_path / "run.npz").write_bytes(b"not a zip file")

        with pytest.raises(StoreError, match="corrupt"):
            store.read("run")

    def test_pickled_arrays_are_not_loaded(self, tmp_path: Path) -> None:
        np.savez(
            tmp_path / "evil.npz",
            __meta__=np.frombuffer(b"{}", np.uint8),
            payload=np.array([{"a": 1}], dtype=object),
        )

        with pytest.raises(StoreError):
            FileStore(tmp_path).read("evil")
