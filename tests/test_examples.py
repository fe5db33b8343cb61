"""The examples run as documented: each one is a subprocess started from the repo root, as a user starts it.

The vLLM example needs .venv-vllm and minutes of engine start-up; its run is
in ``tests/integrations/test_vllm_examples.py`` (where CI runs the vLLM tests).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def run_example(name: str, *args: str, env: dict[str, str] | None = None,
                timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """``python examples/NAME ARGS`` from the repo root, output captured."""
    return subprocess.run([sys.executable, f"examples/{name}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_examples_found():
    """The glob below sees every example (an empty list would make the import check vacuous)."""
    assert {p.name for p in EXAMPLES} >= {"async_quickstart.py", "chat_demo.py", "sglang_hicache.py",
                                          "vllm_offload.py"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_does_not_import_tests(path: Path):
    """No example imports from the test suite (``tests`` is not installed with kvengine), relative imports
    included: an example copied out of the repo must still run."""
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.split(".")[0] == "tests"]
        elif isinstance(node, ast.ImportFrom):
            if node.level or (node.module or "").split(".")[0] == "tests":
                bad.append("." * node.level + (node.module or ""))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
              and str(node.args[0].value).split(".")[0] == "tests"):
            bad.append(str(node.args[0].value))
    assert not bad, f"{path.name} imports {bad}"


def test_async_quickstart_example():
    """examples/async_quickstart.py exits 0 and loads back its full chunks identically."""
    proc = run_example("async_quickstart.py", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "matched 256 of 303 tokens; loaded 256; identical=True" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (kvengine[hf])")
def test_chat_demo_example():
    """examples/chat_demo.py --model random --turns 2 exits 0, the second turn reuses KV, and the cached
    replies match the uncached ones."""
    proc = run_example("chat_demo.py", "--model", "random", "--turns", "2", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "outputs matched: all" in proc.stdout
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("turns 2: reused "))
    assert int(summary.split()[3]) > 0, summary  # "turns 2: reused N of M prompt tokens ..."
    assert "demo finished in" in proc.stdout


def test_sglang_hicache_flags_example():
    """examples/sglang_hicache.py flags exits 0 without SGLang and prints a launch command that loads the
    kvengine backend with the given disk tier."""
    proc = run_example("sglang_hicache.py", "flags", "--disk", "/var/cache/kvengine", "--memory", "8GiB",
                       timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("python -m sglang.launch_server --model-path MODEL ")
    assert "--hicache-storage-backend dynamic" in out
    assert "kvengine.integrations.sglang.backend" in out and '"path": "/var/cache/kvengine"' in out


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="needs SGLang: bash scripts/setup_sglang.sh, then .venv-sglang/bin/python -m pytest")
def test_sglang_hicache_demo_example():
    """examples/sglang_hicache.py demo (under .venv-sglang) loads its 8 stored pages back bit-exact from the disk
    tier in a new engine, and shows the refusal of the page_head layout."""
    proc = run_example("sglang_hicache.py", "demo", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit-exact: True" in proc.stdout
    assert "refused:" in proc.stdout


@pytest.mark.parametrize(("example", "args", "missing", "hint"), [
    ("chat_demo.py", [], "transformers", "pip install 'kvengine[hf]'"),
    ("vllm_offload.py", [], "vllm", "pip install 'kvengine[vllm]'"),
    ("sglang_hicache.py", ["demo"], "sglang", "pip install --no-deps 'sglang==0.5.23'"),
])
def test_missing_dependency_exits_2_with_install_hint(tmp_path: Path, example: str, args: list[str], missing: str,
                                                      hint: str):
    """With an optional dependency missing (simulated by a package on PYTHONPATH that raises the
    ModuleNotFoundError a missing module raises), the example exits 2 with one line on stderr naming the
    module and the pip install command, not a traceback."""
    stub = tmp_path / missing
    stub.mkdir()
    (stub / "__init__.py").write_text(
        f"raise ModuleNotFoundError(\"No module named '{missing}'\", name={missing!r})\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    proc = run_example(example, *args, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"needs {missing}, which is not installed" in lines[0] and hint in lines[0], lines[0]


def test_kv_router_example():
    """examples/kv_router.py: two real engines publish KV events; the router ranks them by the prefix each
    holds, a tail included (instance-b's 40 = two chunks and the third's first 8 tokens; the other prompt
    branches inside that tail, so it gets the chunks only), and forgets an instance that closed
    (AllBlocksCleared)."""
    proc = run_example("kv_router.py", timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "document + question + more (100 tokens): cached tokens by instance: instance-a 80, instance-b 40" in lines
    assert "document's first half + other (72 tokens): cached tokens by instance: instance-a 32, instance-b 32" \
        in lines
    assert "unrelated (48 tokens): cached tokens by instance: instance-a 0, instance-b 0" in lines
    assert "after instance-a closed: cached tokens by instance: instance-b 40, instance-a 0" in lines


def test_kv_router_counts_a_shared_medium_for_every_instance(monkeypatch):
    """A chunk one instance put on a shared medium (Mooncake) is cached for every instance, ranked below an
    instance holding it on its own media, and forgotten for all when its writer removes it or clears."""
    from kvengine.chunks.hashing import prefix_hashes
    from kvengine.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

    spec = importlib.util.spec_from_file_location("kv_router", ROOT / "examples" / "kv_router.py")
    assert spec is not None and spec.loader is not None
    kv_router = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "kv_router", kv_router)  # its dataclasses look their module up
    spec.loader.exec_module(kv_router)
    digest, chunk = b"\x01" * 16, 4
    router = kv_router.KVRouter([kv_router.Instance(n, "tcp://127.0.0.1:1", digest, chunk) for n in ("a", "b")],
                                shared_media=frozenset({"MOONCAKE"}))
    try:
        prompt = list(range(100, 113))  # 3 whole chunks and one token
        hashes = prefix_hashes(prompt, chunk, digest)
        router._apply("a", EventBatch(0.0, (BlockStored(tuple(hashes[:3]), None, b"", chunk, "CPU"),
                                            BlockStored(tuple(hashes[:2]), None, b"", chunk, "MOONCAKE"))))
        assert router.rank(prompt) == [("a", 12), ("b", 8)]
        router._apply("b", EventBatch(0.0, (BlockStored(tuple(hashes[:2]), None, b"", chunk, "MOONCAKE"),)))
        router._apply("a", EventBatch(0.0, (BlockRemoved(tuple(hashes[:2]), "MOONCAKE"),)))
        assert router.cached_tokens("a", prompt) == 12 and router.cached_tokens("b", prompt) == 8  # b's copy
        router._apply("b", EventBatch(0.0, (AllBlocksCleared(),)))
        assert router.cached_tokens("b", prompt) == 0 and router.cached_tokens("a", prompt, local=True) == 12
    finally:
        router.close()
