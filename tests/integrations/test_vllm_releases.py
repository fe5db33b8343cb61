"""The connector against vLLM releases it is not run on: ``scripts/vllm_interfaces.py``.

The checker reads vLLM's Python sources (never importing them): the baseline is the installed vLLM
(0.32 CPU, ``.venv-vllm``), the releases are cached wheels (``~/.cache/kvengine/vllm-wheels``; CI's
``scripts/test.sh`` downloads them first and fails loudly when it cannot). The doctored-source tests
need no network: they edit a symlinked copy of the baseline's sources.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_interfaces.py"
_spec = importlib.util.spec_from_file_location("vllm_interfaces", SCRIPT)
assert _spec is not None and _spec.loader is not None
checker = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("vllm_interfaces", checker)  # dataclasses look their module up there
_spec.loader.exec_module(checker)

BASE = "distributed/kv_transfer/kv_connector/v1/base.py"


@pytest.fixture(scope="module")
def baseline() -> Path:
    try:
        return checker.find_baseline()
    except SystemExit as exc:
        pytest.skip(str(exc))


def _doctored(baseline: Path, tmp_path: Path, rel: str, old: str, new: str) -> Path:
    """A copy of the baseline's sources (files symlinked) with ``old`` replaced by ``new`` in ``vllm/rel``."""
    root = tmp_path / "release"
    shutil.copytree(baseline, root / "vllm", copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    target = root / "vllm" / rel
    text = target.read_text()
    assert old in text, f"{old!r} not in {rel}"
    target.unlink()
    target.write_text(text.replace(old, new, 1))
    return root


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = checker.main(list(argv))
    return rc, capsys.readouterr().out


def _failures(out: str) -> list[str]:
    return re.findall(r"^  FAIL (.+?) \[", out, flags=re.M)


def test_baseline_against_itself_is_all_same(baseline: Path, capsys) -> None:
    """Scenario: the validated release compared with itself: every interface found, nothing fails."""
    rc, out = _run(capsys, str(baseline.parent))
    assert rc == 0, out
    assert "lacks what the connector uses" not in out
    assert re.search(r"\d+ interfaces, (\d+ absent, )?\d+ same; pass", out), out


@pytest.mark.parametrize("case, rel, old, new, failing", [
    ("base-class method renamed", BASE, "def get_num_new_matched_tokens(",
     "def get_num_new_matched_tokens_v2(", "method KVConnectorBase_V1+SupportsHMA.get_num_new_matched_tokens"),
    ("base-class parameter removed", BASE, "        num_computed_tokens: int,\n    ) -> tuple[int | None, bool]:",
     "    ) -> tuple[int | None, bool]:", "method KVConnectorBase_V1+SupportsHMA.get_num_new_matched_tokens"),
    ("spec field renamed", "v1/kv_cache_interface.py", "    sliding_window: int\n", "    window: int\n",
     "attr vllm.v1.kv_cache_interface.SlidingWindowSpec.sliding_window"),
    ("backend stride order changed", "v1/attention/backends/cpu_attn.py", "return (KVCacheLayout.LBHNC,)",
     "return (KVCacheLayout.LBNHC,)", "backend CPU_ATTN.supported_kv_cache_layouts"),
    ("output field removed", "v1/outputs.py", "    failed_recving: set[str]", "    failed_recvs: set[str]",
     "attr vllm.v1.outputs.KVConnectorOutput.failed_recving"),
    ("imported name removed", "v1/metrics/cache_hit_source.py", "class CacheHitSource(", "class HitSource(",
     "import vllm.v1.metrics.cache_hit_source.CacheHitSource"),
])
def test_broken_interface_fails_naming_it(baseline: Path, tmp_path: Path, capsys, case, rel, old, new,
                                          failing) -> None:
    """Regression: a release that breaks an interface the connector implements or reads must fail the check
    with that interface named (before, a vLLM upgrade was found out only when serving broke)."""
    release = _doctored(baseline, tmp_path, rel, old, new)
    rc, out = _run(capsys, str(release))
    assert rc == 1, out
    assert any(f == failing or f.startswith(f"{failing} (") for f in _failures(out)), \
        f"{case}: {failing!r} not among {_failures(out)}"


def test_removed_parameter_is_named_as_incompatible(baseline: Path, tmp_path: Path, capsys) -> None:
    """Scenario: vLLM stops passing a parameter kvengine's override requires: reported as incompatible, naming it."""
    release = _doctored(baseline, tmp_path, BASE, "        num_computed_tokens: int,\n    ) -> tuple[int | None, bool]:",
                        "    ) -> tuple[int | None, bool]:")
    _, out = _run(capsys, str(release))
    assert "get_num_new_matched_tokens (KVEngineConnector) [connector.py]: incompatible" in out
    assert "requires 'num_computed_tokens'" in out


def test_new_base_method_without_a_decision_fails(baseline: Path, tmp_path: Path, capsys) -> None:
    """Scenario: a release adds a base-class method nobody decided about: fails, naming the method."""
    release = _doctored(baseline, tmp_path, BASE, "    def register_kv_caches(",
                        "    def prefers_pinned_pages(self) -> bool:\n        return True\n\n"
                        "    def register_kv_caches(")
    rc, out = _run(capsys, str(release))
    assert rc == 1
    assert "prefers_pinned_pages: UNDECIDED" in out


def test_attribute_moved_behind_hasattr_needs_one_alternative(baseline: Path, tmp_path: Path, capsys) -> None:
    """Scenario: the request's skip flag (0.32 ``skip_reading_prefix_cache``, 0.34 ``skip_reading_external_kv``)
    is read behind ``hasattr``: a release with neither fails, naming both."""
    release = _doctored(baseline, tmp_path, "v1/request.py", "self.skip_reading_prefix_cache =",
                        "self.skip_cache =")
    rc, out = _run(capsys, str(release))
    assert rc == 1
    assert "attr vllm.v1.request.Request.skip_reading_prefix_cache" in _failures(out)
    assert "none of the alternatives" in out


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_current_releases_pass(baseline: Path, capsys, version: str) -> None:
    """0.33 and 0.34 (``[vllm]`` allows them): every checked interface same, reviewed or decided."""
    if not list(checker.WHEEL_CACHE.glob(f"vllm-{version}-*.whl")):
        pytest.skip(f"vllm {version} wheel not cached in {checker.WHEEL_CACHE} (scripts/test.sh downloads it)")
    rc, out = _run(capsys, version)
    assert rc == 0, out
    assert f"vLLM {version}: " in out and "; pass" in out


def test_sleep_mode_is_refused() -> None:
    """vLLM 0.33+ asks the connector class whether it follows sleep mode: kvengine says no (its namespace
    cannot follow weights reloaded after wake-up)."""
    pytest.importorskip("vllm")
    from kvengine.integrations.vllm.connector import KVEngineConnector

    assert KVEngineConnector.supports_sleep_mode(None) is False
