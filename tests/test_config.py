"""Configuration: sources, precedence, and errors that name the key."""

from __future__ import annotations

import pytest

from kvengine.config import load_config, load_config_auto_chunk
from kvengine.errors import ConfigError


def test_defaults():
    """With no file and no environment: chunk_size 256, LRU eviction, write-behind."""
    cfg = load_config(environ={})
    assert cfg.chunk_size == 256 and cfg.memory.eviction == "lru" and cfg.write_mode == "write_behind"


def test_yaml_then_env_override(tmp_path):
    """The environment overrides the YAML file, sizes accept units, and unrelated variables are ignored."""
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
    """An unknown key or an invalid value is a ConfigError naming its dotted key."""
    with pytest.raises(ConfigError) as err:
        load_config(data, environ={})
    assert key in str(err.value)


def test_enum_errors_list_allowed_values():
    """An invalid enum value is refused listing the allowed values."""
    with pytest.raises(ConfigError, match="'lru' or 'fifo'"):
        load_config({"memory": {"eviction": "arc"}}, environ={})


def test_unknown_key_lists_allowed_keys():
    """An unknown key is refused listing the allowed keys."""
    with pytest.raises(ConfigError, match="allowed keys: .*chunk_size"):
        load_config({"chunk_sise": 1}, environ={})


def test_unknown_env_key_fails():
    """A KVENGINE_ variable naming an unknown key is refused, naming it."""
    with pytest.raises(ConfigError, match="memroy"):
        load_config(environ={"KVENGINE_MEMROY__CAPACITY_BYTES": "1"})


def test_bad_yaml_file(tmp_path):
    """A YAML file that is not a mapping is refused."""
    path = tmp_path / "kv.yaml"
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path, environ={})


@pytest.mark.parametrize("data, env, expected", [
    ({}, {}, None),
    ({"chunk_size": "auto"}, {}, None),
    ({"chunk_size": None}, {}, None),
    ({"chunk_size": 512}, {}, 512),
    ({"chunk_size": "512"}, {}, 512),
    ({"chunk_size": 512}, {"KVENGINE_CHUNK_SIZE": "auto"}, None),
    ({}, {"KVENGINE_CHUNK_SIZE": "768"}, 768),
])
def test_auto_chunk_loading_tells_auto_from_an_explicit_size(data, env, expected):
    """Integrations that derive the chunk size from their engine see "auto" (or unset) as None, an
    explicit size as that size, whichever source set it; the rest of the config loads as usual."""
    cfg, chunk = load_config_auto_chunk({**data, "memory": {"capacity_bytes": "64MiB"}}, environ=env)
    assert chunk == expected and cfg.memory.capacity_bytes == 64 << 20


@pytest.mark.parametrize("value", [0, -1, "big", 1.5])
def test_auto_chunk_loading_refuses_other_values_naming_chunk_size_and_auto(value):
    """A chunk_size that is neither a positive integer nor 'auto' is refused, naming chunk_size and 'auto'."""
    with pytest.raises(ConfigError, match=r"chunk_size: .*\(or 'auto'"):
        load_config_auto_chunk({"chunk_size": value}, environ={})


def test_auto_is_not_a_chunk_size_for_the_core_engine():
    """The core engine has no block size to derive from: "auto" is refused there, naming the key."""
    with pytest.raises(ConfigError, match="chunk_size"):
        load_config({"chunk_size": "auto"}, environ={})


def test_list_settings_take_json_from_the_environment():
    """A list setting (peers.peers) can be set from the environment as JSON; invalid JSON is refused
    naming the variable."""
    cfg = load_config(environ={"KVENGINE_PEERS__PEERS": '["10.0.0.2:7400", "10.0.0.3:7400"]'})
    assert cfg.peers.peers == ("10.0.0.2:7400", "10.0.0.3:7400")
    with pytest.raises(ConfigError, match="KVENGINE_PEERS__PEERS: not valid JSON"):
        load_config(environ={"KVENGINE_PEERS__PEERS": '["10.0.0.2:7400",'})


def test_config_file_variable_is_read_when_no_source_is_given(tmp_path):
    """KVENGINE_CONFIG_FILE names the YAML file used when the caller gives none; variables still override
    it; a source the caller gives wins over the file variable."""
    path = tmp_path / "kv.yaml"
    path.write_text("chunk_size: 128\nmemory:\n  eviction: fifo\n")
    env = {"KVENGINE_CONFIG_FILE": str(path), "KVENGINE_MEMORY__EVICTION": "lru"}
    cfg = load_config(environ=env)
    assert cfg.chunk_size == 128 and cfg.memory.eviction == "lru"
    assert load_config({"chunk_size": 64}, environ=env).chunk_size == 64
    with pytest.raises(ConfigError, match="cannot read configuration file .*missing.yaml"):
        load_config(environ={"KVENGINE_CONFIG_FILE": str(tmp_path / "missing.yaml")})


def test_explicit_overrides_win_over_the_environment():
    """A command's explicit arguments (overrides) are never overridden by KVENGINE_ variables, which still
    override the dict or file source."""
    env = {"KVENGINE_CHUNK_SIZE": "512", "KVENGINE_MEMORY__CAPACITY_BYTES": "1GiB"}
    cfg = load_config({"chunk_size": 128, "memory": {"capacity_bytes": "64MiB"}}, environ=env,
                      overrides={"chunk_size": 64})
    assert cfg.chunk_size == 64 and cfg.memory.capacity_bytes == 1 << 30


def test_a_resolved_config_is_final():
    """An EngineConfig passed again is returned as it is: the environment is not applied twice."""
    cfg = load_config({"chunk_size": 128}, environ={})
    assert load_config(cfg, environ={"KVENGINE_CHUNK_SIZE": "512"}) is cfg
    with pytest.raises(ConfigError, match="resolved EngineConfig"):
        load_config(cfg, overrides={"chunk_size": 64})


def test_unknown_keys_suggest_the_closest_one():
    """An unknown key, from a dict or the environment, suggests the closest allowed key."""
    with pytest.raises(ConfigError, match="did you mean 'chunk_size'"):
        load_config({"chunk_sise": 1}, environ={})
    with pytest.raises(ConfigError, match="memroy.*did you mean 'memory'"):
        load_config(environ={"KVENGINE_MEMROY__CAPACITY_BYTES": "1"})
