"""Model identity from the content of the weight files (kvengine.trust.weights), with real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvengine.errors import ConfigError
from kvengine.trust.weights import DigestSidecar, FileStamp, fingerprint_model_path, resolve_model


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    write(d / "model-00001-of-00002.safetensors", os.urandom(3 << 20))
    write(d / "model-00002-of-00002.safetensors", os.urandom(1 << 20))
    write(d / "config.json", b"{}")
    return d


def test_every_byte_counts_even_past_the_first_and_last_mib(model_dir: Path):
    """Regression: only the first and last MiB of each file were hashed. One byte in the middle of a
    3 MiB shard, rewritten in place with the same size and the same mtime, is a new identity."""
    shard = model_dir / "model-00001-of-00002.safetensors"
    before = fingerprint_model_path(model_dir)
    st = shard.stat()
    with open(shard, "r+b") as f:
        f.seek(3 << 19)
        byte = f.read(1)
        f.seek(3 << 19)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))  # as `cp -p` or a restored archive would
    assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    assert fingerprint_model_path(model_dir).digest != before.digest


def test_the_sidecar_skips_unchanged_files_and_misses_rewritten_ones(model_dir: Path, tmp_path: Path):
    """A restart re-hashes nothing unchanged; a rewrite (same size and mtime) misses the sidecar because
    its ctime moved, so only that file is hashed again."""
    sidecar = tmp_path / "sidecar.json"
    cold = fingerprint_model_path(model_dir, sidecar=DigestSidecar(sidecar))
    assert cold.hashed_bytes == cold.total_bytes == 4 << 20 and cold.files == 2
    warm = fingerprint_model_path(model_dir, sidecar=DigestSidecar(sidecar))
    assert warm.hashed_bytes == 0 and warm.digest == cold.digest
    small = model_dir / "model-00002-of-00002.safetensors"
    st = small.stat()
    small.write_bytes(os.urandom(1 << 20))
    os.utime(small, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = fingerprint_model_path(model_dir, sidecar=DigestSidecar(sidecar))
    assert again.hashed_bytes == 1 << 20 and again.digest != cold.digest


def test_a_damaged_sidecar_is_an_empty_one(model_dir: Path, tmp_path: Path):
    """A damaged sidecar is treated as empty: every byte is hashed once, and the next run hashes nothing."""
    sidecar = tmp_path / "sidecar.json"
    sidecar.write_text("{not json")
    result = fingerprint_model_path(model_dir, sidecar=DigestSidecar(sidecar))
    assert result.hashed_bytes == result.total_bytes
    assert fingerprint_model_path(model_dir, sidecar=DigestSidecar(sidecar)).hashed_bytes == 0


def test_names_and_sizes_are_part_of_the_identity(model_dir: Path):
    """Renaming a weight file changes the model's identity."""
    before = fingerprint_model_path(model_dir).digest
    (model_dir / "model-00002-of-00002.safetensors").rename(model_dir / "renamed.safetensors")
    assert fingerprint_model_path(model_dir).digest != before


def test_a_directory_without_weight_files_is_refused(tmp_path: Path):
    """A directory with no weight files is refused, naming model_fingerprint."""
    write(tmp_path / "empty" / "config.json", b"{}")
    with pytest.raises(ConfigError, match="no weight files .* model_fingerprint"):
        fingerprint_model_path(tmp_path / "empty")


def test_a_single_weight_file_is_its_own_identity(tmp_path: Path):
    """A single weight file (here GGUF) is fingerprinted as one file."""
    gguf = write(tmp_path / "m.gguf", os.urandom(1000))
    assert fingerprint_model_path(gguf).files == 1


def test_file_stamp_follows_links_to_the_blob(tmp_path: Path):
    """A file stamp of a symlinked weight file names the blob it resolves to."""
    blob = write(tmp_path / "blobs" / "abc", b"x" * 10)
    link = tmp_path / "snap" / "model.safetensors"
    link.parent.mkdir()
    link.symlink_to(blob)
    assert FileStamp.of(link).path == str(blob.resolve())


def hub_snapshot(cache: Path, repo: str, revision: str, data: bytes) -> Path:
    """A Hugging Face hub cache entry laid out as huggingface_hub writes it (blobs, snapshots, refs)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    blob = write(root / "blobs" / f"blob-{revision}", data)
    snap = root / "snapshots" / revision
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to(os.path.relpath(blob, snap))
    write(snap / "config.json", b"{}")
    write(root / "refs" / "main", revision.encode())
    return snap


def test_hub_ids_resolve_to_their_local_snapshot_and_revision(tmp_path: Path, monkeypatch):
    """A hub id is identified by its downloaded snapshot (revision = commit hash, content hashed); an
    updated snapshot (a new revision under refs/main) is a new identity; an id not in the cache is refused."""
    pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    first = "a" * 40
    snap = hub_snapshot(cache, "org/tiny", first, b"old weights")
    resolved = resolve_model("org/tiny")
    assert resolved.path == snap and resolved.revision == first
    old = fingerprint_model_path(resolved.path).digest
    second = "b" * 40
    hub_snapshot(cache, "org/tiny-next", second, b"new weights")  # a second repo keeps the layout honest
    root = cache / "models--org--tiny"
    blob = write(root / "blobs" / "blob-new", b"new weights")
    snap2 = root / "snapshots" / second
    snap2.mkdir(parents=True)
    (snap2 / "model.safetensors").symlink_to(os.path.relpath(blob, snap2))
    (root / "refs" / "main").write_text(second)
    updated = resolve_model("org/tiny")
    assert updated.revision == second and fingerprint_model_path(updated.path).digest != old
    assert resolve_model("org/tiny", revision=first).path == snap
    with pytest.raises(ConfigError, match="neither a local path nor a snapshot.*model_fingerprint"):
        resolve_model("org/not-downloaded")
