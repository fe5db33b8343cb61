"""Configuration: sources, precedence, and errors that name the key."""

from __future__ import annotations

import pytest

from kvengine.config import load_config
from kvengine.errors import ConfigError


def test_defaults():
    cfg = load_config(environ={})
    assert cfg.chunk_size == 256 and cfg.memory.eviction == "lru" and cfg.write_mode == "write_behind"


def test_yaml_then_env_override(tmp_path):
    path = tmp_path / "kv.yaml"
    path.write_text("chunk_size: 128\nmemory:\n  capacity_bytes: 64MiB\n  eviction: fifo\n")
    cfg = load_config(path, environ={"KVENGINE_MEMORY__CAPACITY_BYTES": "1GiB", "OTHER": "x"})
    assert cfg.chunk_size == 128 and cfg.memory.eviction == "fifo"
    assert cfg.memory.capacity_bytes == 1 << 30


@pytest.mark.parametrize("data,key", [
    ({"chunk_sise": 1}, "chunk_sise"),
    ({"memory": {"eviction": "arc"}}, "memory.eviction"),
    ({"memory": {"capacity_bytes": "lots"}}, "memory.capacity_bytes"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"disk": {"fsync": "sometimes"}}, "disk.fsync"),
])
def test_invalid_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        load_config(data, environ={})
    assert key in str(err.value)


def test_enum_errors_list_allowed_values():
    with pytest.raises(ConfigError, match="'lru' or 'fifo'"):
        load_config({"memory": {"eviction": "arc"}}, environ={})


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError, match="allowed keys: .*chunk_size"):
        load_config({"chunk_sise": 1}, environ={})


def test_unknown_env_key_fails():
    with pytest.raises(ConfigError, match="memroy"):
        load_config(environ={"KVENGINE_MEMROY__CAPACITY_BYTES": "1"})


def test_bad_yaml_file(tmp_path):
    path = tmp_path / "kv.yaml"
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path, environ={})
