"""Which attention backends a worker serves on: validated in-tree, proven by a verification record of the
running platform, or the operator's named risk (``integrations/vllm/acceptance.py``).

Layouts are derived by the connector's own ``derive_layout`` from vLLM's spec classes over CPU tensors, the
records are written and read by ``kvengine.trust.verification``; the end-to-end path (a record written by
``kvengine verify vllm`` unlocking a real engine) is in test_vllm_verify.py.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed (use .venv-vllm, see docs/vllm.md)")

BS = 32
SECRET = b"0123456789abcdef0123456789abcdef"


def _layout(backend: str):
    import vllm.v1.kv_cache_interface as kvi

    from kvengine.integrations.vllm.layout import derive_layout, plan_groups, resolve_chunking

    spec = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=32, dtype=torch.float32)
    plans = plan_groups(kvi.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        kvi.KVCacheGroupSpec(layer_names=["l0"], kv_cache_spec=spec)]))
    return derive_layout(resolve_chunking(plans, 2 * BS, world_size=1), {"l0": torch.zeros(16, 2, BS, 64)},
                         {"l0": backend}, "LBHNC", num_blocks=16, fingerprint="fp")


def _namespace(layout, fingerprint: str = "model-fp"):
    from kvengine.chunks.keys import Namespace

    return Namespace(model="/models/m", model_fingerprint=fingerprint, kv_spec_fingerprint=layout.spec_fingerprint,
                     layout_id=f"vllm-0.32.0/{layout.layout_id}")


def _platform(layout, namespace):
    from kvengine.integrations.vllm.acceptance import vllm_platform

    return vllm_platform(layout, namespace, "cpu")


def _record(platform, fingerprint: str = "model-fp"):
    from kvengine.trust.verification import GroupVerdict, Outcome, VerificationRecord, kvengine_version, now

    return VerificationRecord(platform=platform, kvengine_version=kvengine_version(), model="/models/m",
                              model_fingerprint=fingerprint, date=now(), groups=(GroupVerdict(
                                  group="group 0 (full_attention)", outcome=Outcome.EXACT, max_state_error=None,
                                  max_logprob_error=0.0, max_logit_error=None, tokens_loaded=512),))


def _options(records, **kw):
    from kvengine.integrations.vllm.options import VerificationOptions

    return VerificationOptions(records=records, **kw)


def test_a_gpu_backend_is_derived_but_needs_proof_and_the_cpu_backend_does_not():
    """derive_layout lays out a GPU backend's pages (through vLLM's logical view) and marks it unproven; the CPU
    backend is validated in-tree and is accepted without any record."""
    from kvengine.integrations.vllm.acceptance import Acceptance, accept_backends

    gpu, cpu = _layout("FLASH_ATTN"), _layout("CPU_ATTN")
    assert gpu.unproven_backends == {"FLASH_ATTN"} and gpu.layout_id.startswith("vllm:FLASH_ATTN:LBHNC")
    assert cpu.unproven_backends == frozenset()
    ns = _namespace(cpu)
    assert accept_backends(cpu, _platform(cpu, ns), ns, _options("/nonexistent")) is Acceptance.VALIDATED


def test_without_a_record_a_gpu_backend_refuses_to_start_naming_the_command(tmp_path):
    from kvengine.errors import UnsupportedModelError
    from kvengine.integrations.vllm.acceptance import accept_backends

    layout = _layout("FLASH_ATTN")
    ns = _namespace(layout)
    with pytest.raises(UnsupportedModelError, match=r"FLASH_ATTN has not been validated in-tree.*no record.*"
                                                    r"kvengine verify vllm --model /models/m"):
        accept_backends(layout, _platform(layout, ns), ns, _options(tmp_path))


def test_a_matching_sealed_record_unlocks_the_backend(tmp_path):
    from kvengine.integrations.vllm.acceptance import Acceptance, accept_backends
    from kvengine.trust.verification import write_record

    layout = _layout("FLASH_ATTN")
    ns = _namespace(layout)
    platform = _platform(layout, ns)
    (tmp_path / "secret").write_bytes(SECRET)
    write_record(tmp_path / "records", _record(platform), SECRET)
    options = _options(tmp_path / "records", secret_file=tmp_path / "secret")
    assert accept_backends(layout, platform, ns, options) is Acceptance.RECORD


@pytest.mark.parametrize("edit, reason", [
    (lambda body: body["platform"].update(accelerator_model="NVIDIA H100 80GB HBM3"), "content digest"),
    ("other platform", "recorded on another platform"),
    ("other model", "recorded for another model"),
    ("unsealed", "not sealed, but a secret is configured"),
])
def test_a_record_of_another_platform_or_model_or_edited_unlocks_nothing(tmp_path, edit, reason):
    """A record edited in place (digest), one re-written for another platform or model (found under the running
    platform's name, as a copied file would be), or one without the configured seal: refused, naming why."""
    from kvengine.errors import UnsupportedModelError
    from kvengine.integrations.vllm.acceptance import accept_backends
    from kvengine.trust.verification import record_name, serialise, write_record

    layout = _layout("FLASH_ATTN")
    ns = _namespace(layout)
    platform = _platform(layout, ns)
    records = tmp_path / "records"
    (tmp_path / "secret").write_bytes(SECRET)
    path = write_record(records, _record(platform), SECRET)
    if callable(edit):
        data = json.loads(path.read_text())
        edit(data["record"])
        path.write_text(json.dumps(data))
    elif edit == "other platform":
        other = dataclasses.replace(platform, accelerator_model="NVIDIA H100 80GB HBM3")
        path.write_bytes(serialise(_record(other), SECRET))
    elif edit == "other model":
        path.write_bytes(serialise(_record(platform, "another-model"), SECRET))
    else:
        path.write_bytes(serialise(_record(platform), None))
    assert path.name == record_name(platform, "model-fp", _record(platform).kvengine_version)
    with pytest.raises(UnsupportedModelError, match=reason):
        accept_backends(layout, platform, ns, _options(records, secret_file=tmp_path / "secret"))


def test_the_named_risk_serves_without_a_record_and_says_so_loudly(tmp_path, caplog):
    from kvengine.integrations.vllm.acceptance import Acceptance, accept_backends

    layout = _layout("FLASH_ATTN")
    ns = _namespace(layout)
    options = _options(tmp_path, serve_unverified_backend_risking_wrong_outputs=True)
    with caplog.at_level(logging.ERROR, logger="vllm.kvengine"):
        assert accept_backends(layout, _platform(layout, ns), ns, options) is Acceptance.RISK_ACCEPTED
    (line,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "SERVING ON UNVERIFIED ATTENTION BACKEND FLASH_ATTN" in line.getMessage()


def test_verification_options_refuse_bad_input_by_name():
    from kvengine.errors import ConfigError
    from kvengine.integrations.vllm.options import ConnectorOptions

    cases = [({"verification": "yes"}, "must be a mapping"),
             ({"verification": {"record": "/x"}}, r"unknown kv_connector_extra_config\['verification'\] keys"),
             ({"verification": {"records": 3}}, "verification.records must be a path"),
             ({"verification": {"serve_unverified_backend_risking_wrong_outputs": "true"}}, "must be true or false")]
    for extra, match in cases:
        with pytest.raises(ConfigError, match=match):
            ConnectorOptions.from_extra_config(extra)
    options = ConnectorOptions.from_extra_config({"verification": {"records": "~/r"}})
    assert options.verification.records.name == "r" and not options.verification.records.name.startswith("~")


def test_the_platform_round_trips_through_the_workers_info_metric():
    """``kvengine verify vllm`` writes its record from the labels the worker publishes: the same Platform."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvengine.integrations.vllm.acceptance import Acceptance, platform_from_labels, publish_platform
    from kvengine.metrics import parse_key, parse_samples

    layout = _layout("FLASH_ATTN")
    ns = _namespace(layout)
    platform = _platform(layout, ns)
    registry = CollectorRegistry()
    publish_platform(registry, platform, ns, Acceptance.RECORD)
    (key,) = [k for k in parse_samples(generate_latest(registry).decode())
              if k.startswith("kvengine_vllm_platform_info{")]
    _, labels = parse_key(key)
    assert labels["acceptance"] == "record"
    assert platform_from_labels(labels) == (platform, "model-fp")
