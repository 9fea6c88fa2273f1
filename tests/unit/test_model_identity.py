"""What identifies a model folder (lmbatch/model/identity.py): each file's content hash, kept under the
file's stamp (size, modification and change times, inode), so a repeat reads nothing, and a file written
in place is hashed again even with its modification time put back (issue 47)."""
from __future__ import annotations

import hashlib
import os
import time

import pytest

from lmbatch.model import identity


@pytest.fixture()
def counted(tmp_path, monkeypatch):
    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(identity, "SEGMENT", 1 << 10)      # several segments, hashed in parallel
    monkeypatch.setattr(identity, "BLOCK", 300)
    monkeypatch.setattr(identity, "RACY_NS", 0)         # files written here are kept at once
    reads: list[int] = []
    real = identity._segment

    def segment(path, start, size):
        reads.append(size)
        return real(path, start, size)
    monkeypatch.setattr(identity, "_segment", segment)
    return reads


def test_a_files_hash_is_of_its_segments_and_kept_by_its_stamp(tmp_path, counted):
    f = tmp_path / "model.safetensors"
    data = os.urandom(5000)
    f.write_bytes(data)
    digest = identity.hash_files([f])[f]
    segments = b"".join(hashlib.sha256(data[i:i + 1024]).digest() for i in range(0, 5000, 1024))
    assert digest == "sha256-seg256m:" + hashlib.sha256((5000).to_bytes(8, "little") + segments).hexdigest()
    assert sum(counted) == 5000
    assert identity.hash_files([f])[f] == digest and sum(counted) == 5000      # kept: nothing read


@pytest.mark.parametrize("restore_mtime", [False, True])
def test_a_file_written_in_place_is_hashed_again(tmp_path, counted, restore_mtime):
    f = tmp_path / "model.safetensors"
    f.write_bytes(bytes(4096))
    st = f.stat()
    before = identity.model_identity(tmp_path)
    assert identity.model_identity(tmp_path) == before and sum(counted) == 4096     # kept
    time.sleep(0.05)                # past the file clock's tick (identity.RACY_NS guards that in use)
    with open(f, "r+b") as fh:      # same size, same inode
        fh.seek(2000)
        fh.write(b"\x01")
    if restore_mtime:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert f.stat().st_mtime_ns == st.st_mtime_ns and f.stat().st_size == st.st_size
    after = identity.model_identity(tmp_path)
    assert after["model.safetensors"] != before["model.safetensors"]
    assert sum(counted) == 2 * 4096


def test_hidden_files_are_not_part_of_the_model(tmp_path, counted):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / ".lock").write_text("x")
    assert list(identity.model_identity(tmp_path)) == ["config.json"]


def test_a_hash_made_just_after_a_write_is_not_kept(tmp_path, counted, monkeypatch):
    monkeypatch.setattr(identity, "RACY_NS", 2_000_000_000)
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    identity.hash_files([f])
    assert not (tmp_path / "cache" / "file-hashes").exists()


def test_an_unwritable_cache_only_costs_the_hash_again(tmp_path, counted, monkeypatch):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("LMBATCH_CACHE", str(tmp_path / "file"))     # a file where the folder should be
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    assert identity.hash_files([f]) == identity.hash_files([f]) and len(counted) == 2
