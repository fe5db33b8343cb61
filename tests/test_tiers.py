"""The one tier builder (kvengine.tiers): configured tiers are built or refused, and a transport from
another package, registered under the ``kvengine.transports`` entry-point group, is loadable by name."""

from __future__ import annotations

import asyncio
import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvengine import ConfigError, KVEngine, Namespace, load_config
from kvengine.tiers import build_tiers, transport_names

from .conftest import CHUNK, FakeKV, copier, make_layout

#: A whole out-of-tree plugin: a package and the dist-info that registers its transport.
PLUGIN = '''
STORES = {}


class DictTransport:
    """Records in a dict shared by every instance with the same ``label``."""

    def __init__(self, label):
        self.name = "dict_tier"
        self.records = STORES.setdefault(label, {})

    async def put(self, items):
        for key, record in items:
            self.records[key] = bytes(record)
        return [True] * len(items)

    async def get(self, keys):
        return [self.records.get(k) for k in keys]

    async def exists(self, keys):
        return [k in self.records for k in keys]

    async def delete(self, keys):
        return [self.records.pop(k, None) is not None for k in keys]

    async def close(self):
        pass


def create_transport(options):
    if set(options) != {"label"}:
        raise TypeError(f"dict_tier takes one option, label; got {sorted(options)}")
    return DictTransport(options["label"])
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    package = tmp_path / "kvengine_dict_tier"
    package.mkdir()
    (package / "__init__.py").write_text(PLUGIN)
    info = tmp_path / "kvengine_dict_tier-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvengine-dict-tier\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [kvengine.transports]
        dict_tier = kvengine_dict_tier:create_transport
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield sys.modules.get("kvengine_dict_tier")
    sys.modules.pop("kvengine_dict_tier", None)


def test_a_registered_out_of_tree_transport_serves_as_a_tier(plugin) -> None:
    """Scenario: a package registers ``dict_tier``; an engine configured with it by name writes there, and a
    fresh engine (empty memory) hits from it, exactly."""
    assert "dict_tier" in transport_names()
    layout = make_layout()
    cfg = {"chunk_size": CHUNK, "memory": {"capacity_bytes": 8 * layout.nbytes()}, "write_mode": "write_through",
           "tiers": [{"transport": "dict_tier", "options": {"label": "shared"}}]}
    kv = FakeKV(2 * CHUNK, seed=3)
    toks = list(range(2 * CHUNK))
    with KVEngine(cfg) as a:
        assert [t.name for t in a._core.transports] == ["dict_tier"]
        assert a.store(a.bind(Namespace(model="m"), layout), toks, kv.source).stored_chunks == 2
    with KVEngine(cfg) as b:
        binding = b.bind(Namespace(model="m"), layout)
        out = [torch.zeros_like(t) for t in kv.layers]
        result = b.load(b.lookup(binding, "r", toks), copier(out))
        assert result.loaded_tokens == 2 * CHUNK and all(torch.equal(o, k) for o, k in zip(out, kv.layers))
        assert b.metrics.value("kvengine_loaded_bytes_total", tier="dict_tier") == 2 * layout.nbytes()


def test_a_plugin_that_rejects_its_options_is_refused_naming_the_tier(plugin) -> None:
    """A plugin transport that rejects its options is refused, naming the tier's index and the plugin's reason."""
    with pytest.raises(ConfigError, match=r"tiers\[0\]: the dict_tier transport could not be built.*label"):
        build_tiers(load_config({"tiers": [{"transport": "dict_tier", "options": {"colour": "red"}}]}, environ={}))


def test_an_unknown_transport_name_is_refused_listing_what_is_installed() -> None:
    """An unknown transport name is refused, listing the installed transports."""
    with pytest.raises(ConfigError, match=r"no transport named 'nope'.*local_disk, mooncake, peers_tcp, peers_ucx, peers_zmq"):
        KVEngine({"tiers": [{"transport": "nope"}]})


def test_peers_without_a_disk_are_a_tier_and_the_order_is_disk_peers_plugins(tmp_path: Path, plugin) -> None:
    """Tiers are built disk, peers, plugins, each with its own codec and setting name; peers alone are a tier."""
    config = load_config({"disk": {"path": str(tmp_path / "d")}, "peers": {"peers": ["127.0.0.2:1"]},
                          "tiers": [{"transport": "dict_tier", "codec": "lz4", "options": {"label": "x"}}]},
                         environ={})
    tiers = build_tiers(config)
    assert [(t.transport.name, t.codec, t.setting) for t in tiers] == [
        ("local_disk", "raw", "disk.codec"), ("peers_tcp", "raw", "peers.codec"), ("dict_tier", "lz4", "tiers[0].codec")]
    only_peers = build_tiers(load_config({"peers": {"peers": ["127.0.0.2:1"]}}, environ={}))
    assert [t.transport.name for t in only_peers] == ["peers_tcp"]


def test_bundled_tiers_are_built_from_their_typed_sections(tmp_path: Path) -> None:
    """The disk and peer tiers take the typed config sections as they are (no dict round trip): every
    setting arrives, and an extra disk option the transport does not know is refused by name."""
    config = load_config({"disk": {"path": str(tmp_path / "d"), "capacity_bytes": "3MiB", "fsync": "never"},
                          "peers": {"peers": ["127.0.0.2:1"], "replicas": 1, "read_deadline": 0.25,
                                    "transport": "tcp"}}, environ={})
    disk, peers = (t.transport for t in build_tiers(config, disk_options={"io_threads": 2}))
    assert (disk.options.capacity_bytes, disk.options.fsync, disk.options.io_threads) == (3 << 20, "never", 2)
    assert (peers.options.replicas, peers.options.read_deadline, peers.name) == (1, 0.25, "peers_tcp")
    with pytest.raises(ConfigError, match=r"unknown local_disk options \['io_thread'\]; allowed: .*io_threads"):
        build_tiers(config, disk_options={"io_thread": 2})


def test_a_disk_path_whose_parent_is_missing_is_refused_not_created(tmp_path: Path) -> None:
    """A ``disk.path`` under a missing directory (an unmounted volume) is a ConfigError naming the missing
    parent; nothing is created on the filesystem that would have stood in for it. The directory itself is
    still created when its parent exists."""
    missing = tmp_path / "not-mounted" / "kv"
    with pytest.raises(ConfigError, match=r"disk.*parent .*not-mounted does not exist"):
        build_tiers(load_config({"disk": {"path": str(missing)}}))
    assert not (tmp_path / "not-mounted").exists()
    tiers = build_tiers(load_config({"disk": {"path": str(tmp_path / "kv"), "capacity_bytes": "1MiB"}}))
    assert (tmp_path / "kv").is_dir() and len(tiers) == 1
    for tier in tiers:
        asyncio.run(tier.transport.close())
