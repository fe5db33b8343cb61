"""Configuration limits: each out-of-range setting is a ConfigError naming the key and the limit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvengine import CacheEngine, KVEngine, load_config
from kvengine.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def test_chunk_size_true_in_yaml_is_refused(tmp_path):
    """Regression: ``chunk_size: true`` (YAML's boolean) was accepted as a chunk of 1 token. It is now a
    ConfigError naming chunk_size."""
    path = tmp_path / "kv.yaml"
    path.write_text("chunk_size: true\n")
    with pytest.raises(ConfigError, match=r"chunk_size: must be a number, got the boolean True"):
        load_config(path, environ={})


@pytest.mark.parametrize("data,key", [
    ({"chunk_size": False}, "chunk_size"),
    ({"lease_seconds": True}, "lease_seconds"),
    ({"max_pending_writes": True}, "max_pending_writes"),
    ({"memory": {"capacity_bytes": True}}, "memory.capacity_bytes"),
    ({"memory": {"slab_bytes": True}}, "memory.slab_bytes"),
    ({"peers": {"replicas": True}}, "peers.replicas"),
    ({"metrics_port": True}, "metrics_port"),
    ({"shadow": {"fraction": True}}, "shadow.fraction"),
])
def test_booleans_are_refused_for_every_numeric_key(data, key):
    """No count, size or duration takes true/false as 1/0 (pydantic's lax mode would)."""
    with pytest.raises(ConfigError, match=rf"{key}: must be a number, got the boolean"):
        load_config(data, environ={})


def test_numbers_from_the_environment_still_convert():
    """Environment variables are strings; numeric keys still take them."""
    cfg = load_config(environ={"KVENGINE_CHUNK_SIZE": "64", "KVENGINE_MEMORY__CAPACITY_BYTES": "4KiB",
                               "KVENGINE_LEASE_SECONDS": "2.5"})
    assert (cfg.chunk_size, int(cfg.memory.capacity_bytes), cfg.lease_seconds) == (64, 4096, 2.5)


@pytest.mark.parametrize("key,value", [("capacity_bytes", 100), ("capacity_bytes", "1000B"), ("slab_bytes", 1),
                                       ("slab_bytes", 1023)])
def test_memory_sizes_below_the_floor_are_refused_naming_key_and_limit(key, value):
    """Regression: ``memory.capacity_bytes: 100`` was accepted (an engine whose memory holds no chunk), and
    ``memory.slab_bytes: 1`` failed at start-up with "a slab of 0 B". Each is now a ConfigError naming the
    key and the 1 KiB floor."""
    with pytest.raises(ConfigError, match=rf"memory\.{key}: must be at least 1024 B \(1KiB\), got"):
        load_config({"memory": {key: value}}, environ={})


def test_the_floor_itself_is_accepted():
    """1 KiB of memory and 1 KiB slabs are allowed (tiny test engines use them)."""
    cfg = load_config({"memory": {"capacity_bytes": 1024, "slab_bytes": 1024}}, environ={})
    assert cfg.memory.effective_slab_bytes() == 1024


def test_slab_larger_than_capacity_names_both_sizes():
    """A slab that exceeds the capacity is refused naming both keys and their values."""
    with pytest.raises(ConfigError, match=r"memory\.slab_bytes \(2097152 B\) must not exceed "
                                          r"memory\.capacity_bytes \(1048576 B\)"):
        load_config({"memory": {"capacity_bytes": "1MiB", "slab_bytes": "2MiB"}}, environ={})


def _physical_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not hasattr(os, "sysconf"), reason="needs os.sysconf for the machine's memory")
@pytest.mark.parametrize("build", ["KVEngine", "CacheEngine"])
def test_capacity_beyond_physical_memory_is_a_config_error(build):
    """Regression: ``memory.capacity_bytes: 64TiB`` failed with a bare ``OSError: Cannot allocate memory``.
    It is now a ConfigError naming memory.capacity_bytes, the size asked for and the machine's memory."""
    if _physical_bytes() >= 64 * 2**40:
        pytest.skip("this machine has 64 TiB of memory")
    config = {"memory": {"capacity_bytes": "64TiB"}}
    with pytest.raises(ConfigError, match=r"memory\.capacity_bytes: a host arena of 64\.0 TiB exceeds this "
                                          r"machine's physical memory \(\d+\.\d [GT]iB\)"):
        if build == "KVEngine":
            KVEngine(config)
        else:
            CacheEngine(load_config(config, environ={}))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_an_arena_the_system_refuses_is_a_config_error():
    """Regression: a capacity within physical memory that the system still refuses (here: an address-space
    limit) surfaced as a bare OSError. It is now a ConfigError naming memory.capacity_bytes and the size."""
    script = textwrap.dedent("""
        import re, resource
        from kvengine import KVEngine
        from kvengine.errors import ConfigError
        vm = int(re.search(r"VmSize:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (512 << 20), resource.RLIM_INFINITY))
        try:
            KVEngine({"memory": {"capacity_bytes": "2GiB"}})
        except ConfigError as exc:
            print("ConfigError:", exc)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                         cwd=REPO)
    assert "ConfigError: memory.capacity_bytes: cannot allocate a host arena of 2.0 GiB" in out.stdout, \
        out.stdout + out.stderr
