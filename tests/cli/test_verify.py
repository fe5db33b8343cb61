"""``kvengine verify hf``: the proof on tiny models, its record, and what a record unlocks.

Through the CLI entry function (``kvengine.cli.main``), with real engines
(memory, or a real disk tier read by a fresh engine) and tiny transformers models.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest

pytest.importorskip("transformers")

from kvengine.cli import main
from kvengine.trust.verification import Platform, VerificationRecord, find_matching, kvengine_version, serialise

SECRET = b"0123456789abcdef0123456789abcdef"


def _config(tmp_path, *, chunk: int = 16, disk: bool = False):
    path = tmp_path / "kvengine.yaml"
    text = f"chunk_size: {chunk}\nmemory:\n  capacity_bytes: 64MiB\n"
    if disk:
        text += f"disk:\n  path: {tmp_path / 'disk'}\n"
    path.write_text(text)
    return path


def _run(capsys, *argv):
    code = main(["verify", "hf", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def llama_record(tmp_path_factory):
    """One proven run of tiny llama over a disk tier (fresh reader engine), sealed: (records dir, path, stdout)."""
    tmp = tmp_path_factory.mktemp("verify")
    secret = tmp / "secret"
    secret.write_bytes(SECRET)
    records = tmp / "records"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(["verify", "hf", "--model", "tiny:llama", "--config", str(_config(tmp, disk=True)),
                     "--records", str(records), "--secret-file", str(secret)])
    files = sorted(records.glob("*.json"))
    return code, buf.getvalue(), records, files


def _platform_of(path) -> tuple[Platform, str, str]:
    body = json.loads(path.read_text())["record"]
    return Platform.from_dict(body["platform"]), body["model_fingerprint"], body["kvengine_version"]


def test_verify_hf_tiny_llama_is_exact_per_group_and_writes_a_record(llama_record):
    """Scenario: the proof over a disk tier with a fresh reader prints EXACT per group with tokens loaded and
    writes one sealed record."""
    code, out, _, files = llama_record
    assert code == 0, out
    groups = [line for line in out.splitlines() if line.startswith("group ")]
    assert groups and all(re.search(r": EXACT \((bitwise|within the dtype's tolerance)\)  tokens loaded [1-9]", g) for g in groups)
    assert all(int(g.split("tokens loaded ")[1].split(",")[0]) > 0 for g in groups)
    assert len(files) == 1 and f"record written to {files[0]} (sealed)" in out
    assert "reader pass on a fresh engine over the disk tier" in out
    # the first prompt preempted halfway and resumed in the fresh reader: its resumed request reused KV
    resumed = re.search(r"reader pass: preempted and resumed: reused (\d+) of", out)
    assert resumed and int(resumed.group(1)) > 0


def test_verify_hf_stateful_family_is_exact(tmp_path, capsys):
    """Scenario: a hybrid (Qwen3-Next: linear-attention state + full attention) is EXACT in both groups."""
    code, out, err = _run(capsys, "--model", "tiny:qwen3_next", "--config", str(_config(tmp_path)),
                          "--records", str(tmp_path / "records"))
    assert code == 0, out + err
    groups = [line for line in out.splitlines() if line.startswith("group ")]
    assert len(groups) == 2 and all(re.search(r": EXACT \((bitwise|within the dtype's tolerance)\)  tokens loaded [1-9]", g) for g in groups)
    assert len(list((tmp_path / "records").glob("*.json"))) == 1


def test_record_is_found_for_the_same_platform_model_and_version(llama_record):
    """Scenario: the record written unlocks exactly the platform, model and version it was written for."""
    _, _, records, files = llama_record
    platform, fingerprint, version = _platform_of(files[0])
    assert version == kvengine_version()
    found = find_matching(records, platform, fingerprint, version, SECRET)
    assert found is not None and found.exact and found.model_fingerprint == fingerprint


@pytest.mark.parametrize("edit", ["cpu model", "torch version", "model fingerprint", "kvengine version"])
def test_a_record_of_another_platform_model_or_version_unlocks_nothing(llama_record, tmp_path, edit):
    """Scenario: the record edited to another CPU model, torch version, model or kvengine version (under the
    running platform's file name) is refused, sealed or not; so is a lookup from another platform."""
    _, _, records, files = llama_record
    platform, fingerprint, version = _platform_of(files[0])
    data = json.loads(files[0].read_text())
    body = data["record"]
    if edit == "cpu model":
        body["platform"]["accelerator_model"] = "Some Other CPU"
    elif edit == "torch version":
        body["platform"]["torch_version"] = "0.0.1"
    elif edit == "model fingerprint":
        body["model_fingerprint"] = "another-model"
    else:
        body["kvengine_version"] = "0.0.0"
    edited = tmp_path / "records"
    edited.mkdir()
    (edited / files[0].name).write_text(json.dumps(data))
    assert find_matching(edited, platform, fingerprint, version, SECRET) is None  # the seal breaks
    assert find_matching(edited, platform, fingerprint, version, None) is None  # the digest breaks

    resealed = VerificationRecord.from_body(body)  # an editor who could re-seal still gets nothing
    (edited / files[0].name).write_bytes(serialise(resealed, SECRET))
    assert find_matching(edited, platform, fingerprint, version, SECRET) is None


def test_a_run_that_loads_nothing_fails(tmp_path, capsys):
    """Scenario: a chunk size larger than every prompt: nothing is stored or loaded, the run fails (exit 1)
    saying so, and writes no record."""
    code, out, err = _run(capsys, "--model", "tiny:llama", "--config", str(_config(tmp_path, chunk=64)),
                          "--prompt-tokens", "20", "--records", str(tmp_path / "records"))
    assert code == 1
    assert "loaded nothing" in err and ": DIFFERS  tokens loaded 0" in out
    assert not (tmp_path / "records").exists()


def test_a_run_past_max_seconds_fails(tmp_path, capsys):
    """Scenario: a time bound too small for the proof fails it, naming the bound; no record."""
    code, _, err = _run(capsys, "--model", "tiny:llama", "--config", str(_config(tmp_path)), "--max-seconds",
                        "0.001", "--records", str(tmp_path / "records"))
    assert code == 1 and "past --max-seconds 0.001" in err
    assert not (tmp_path / "records").exists()


def test_a_model_refused_at_attach_exits_2(tmp_path, capsys):
    """Scenario: an encoder-decoder model (not covered by verify hf yet) is refused with exit 2, naming why."""
    code, _, err = _run(capsys, "--model", "tiny:t5", "--config", str(_config(tmp_path)),
                        "--records", str(tmp_path / "records"))
    assert code == 2 and "refused at attach" in err and "encoder-decoder" in err


def test_unknown_tiny_family_and_missing_model_dir_are_usage_errors(tmp_path, capsys):
    """Scenario: a bad --model is one line naming it, exit 2."""
    assert _run(capsys, "--model", "tiny:nope")[0] == 2
    code, _, err = _run(capsys, "--model", str(tmp_path / "none"))
    assert code == 2 and "no config.json" in err


def test_a_checkpoint_whose_generation_config_sets_a_repetition_penalty_is_still_verified() -> None:
    """Regression: ``kvengine verify hf`` exited 2 on models whose generation config sets a field kvengine's loop
    refuses (``repetition_penalty``, as many released checkpoints do). The proof decodes both sides under a
    neutral config, and the model's own config is restored after."""
    from kvengine import KVEngine
    from kvengine.integrations.hf.tiny_models import build_tiny
    from kvengine.integrations.hf.verify_run import run_proof

    model = build_tiny("llama", seed=5)
    model.generation_config.repetition_penalty = 1.3
    result = run_proof(model, lambda: KVEngine({"chunk_size": 16, "memory": {"capacity_bytes": "64MiB"}}),
                       fresh_reader=False, model_id="tiny-llama-penalty")
    assert result.ok and result.tokens_loaded > 0
    assert model.generation_config.repetition_penalty == 1.3


@pytest.mark.parametrize("peak, settled, growth", [(6, 5, 1), (6, 3, 1), (8, 8, 2), (14, 9, 2), (5, 5, 2)])
def test_vllm_budget_from_measured_blocks_admits_every_preempted_request_then_overflows(peak, settled, growth):
    """``kvengine verify vllm`` with several KV cache groups: the budget it sizes from one request's measured
    blocks admits all the preempted-size requests even once the first ones decoded past their first block
    boundary (regression: sized for the others merely settled, the last waited until the first ones finished,
    and a CI run preempted none), and the planned decode then overflows it."""
    from kvengine.integrations.vllm.verify_run import PREEMPTED_REQUESTS, _Plan

    first = _Plan.of(256, 256, 16, kinds=2)
    assert not first.calibrated
    plan = first.calibrate(peak, settled, growth)
    assert plan.calibrated and (plan.block, plan.chunk, plan.per_request) == (256, 256, first.per_request)
    n = PREEMPTED_REQUESTS
    free = plan.budget - 1  # vLLM keeps one null block
    assert (n - 1) * (settled + growth) + peak <= free  # the last is admitted beside the others, grown once
    # all of them, past their first boundary and the planned ones after it, want more than the pool
    assert n * (settled + (1 + plan.boundaries) * growth) > free
    prompt = plan.per_request * plan.block - 1
    # the decode crosses the last boundary: the (3 + j block)th token is the first past it
    assert plan.decode >= 3 + plan.boundaries * plan.block and plan.decode - 2 - plan.boundaries * plan.block == 16
    assert plan.max_len >= prompt + plan.decode and plan.max_len % plan.block == 0


def test_vllm_one_group_budget_admits_two_preempted_requests_and_leaves_nothing_to_grow():
    from kvengine.integrations.vllm.verify_run import _Plan

    plan = _Plan.of(128, None, 16, kinds=1)
    assert plan.calibrated and plan.boundaries == 0 and plan.budget - 1 == 2 * plan.per_request
    assert plan.max_len >= plan.per_request * plan.block - 1 + plan.decode


def test_vllm_budget_refuses_a_request_that_does_not_grow():
    from kvengine.errors import UnsupportedModelError
    from kvengine.integrations.vllm.verify_run import _Plan

    with pytest.raises(UnsupportedModelError, match="cannot size a KV budget that preempts"):
        _Plan.of(256, 256, 16, kinds=2).calibrate(6, 5, 0)


def test_vllm_preempted_requests_whose_outputs_follow_step_timing_are_not_judged():
    """A recurrent-state model's below fp32, or any model's where the proof measured a split prefill moving
    outputs past the tolerance for requests run alone: their outputs follow where vLLM resumed them (step
    timing), log-probabilities and, at times, greedy tokens (1 of 2 CI runs, 2026-12-06; bf16 MLA on AMX,
    2026-12-07); everything else keeps its bound and every section its token check."""
    import math

    from kvengine.integrations.vllm.verify_run import ALONE_TOLERANCE, _preempted_bound
    from kvengine.trust.proof_run import LOGPROB_TOLERANCE

    assert _preempted_bound("bfloat16", True, 0.0) == _preempted_bound("float16", True, 0.0) == math.inf
    assert _preempted_bound("float32", True, 0.0) == LOGPROB_TOLERANCE["float32"]
    assert _preempted_bound("bfloat16", False, 0.0) == LOGPROB_TOLERANCE["bfloat16"]
    assert _preempted_bound("bfloat16", False, ALONE_TOLERANCE["bfloat16"]) == LOGPROB_TOLERANCE["bfloat16"]
    assert _preempted_bound("bfloat16", False, 0.015) == math.inf
    assert _preempted_bound("float32", False, 2e-4) == math.inf
    from kvengine.integrations.vllm.verify_run import PREEMPTION, _differences, _Output

    want = {PREEMPTION: [_Output([1, 2, 3], [0.0] * 3)], "shared prefix": [_Output([4, 5], [0.0] * 2)]}
    got = {PREEMPTION: [_Output([1, 9, 3], [0.0] * 3)], "shared prefix": [_Output([4, 5], [0.0] * 2)]}
    assert _differences("writer", got, want) == [
        "writer pass, preemption (request 0): greedy token 1 differs from vLLM without the connector"]
    assert _differences("writer", got, want, {PREEMPTION}) == []
    got["shared prefix"] = [_Output([4, 6], [0.0] * 2)]
    assert len(_differences("writer", got, want, {PREEMPTION})) == 1


def test_vllm_a_reader_control_off_the_reference_fails_naming_the_platform():
    """The fresh reader engine's request with nothing cached must compute what the reference engine does: a
    drift past the bound, or a greedy token apart, fails the proof as the platform's (engine starts that
    compute differently), whatever the hits did; within it, nothing is said."""
    from kvengine.integrations.vllm.verify_run import _control_failure, _Output

    reference = _Output([1, 2, 3], [-0.5, -1.0, -0.25])
    assert _control_failure("full and partial chunks", _Output([1, 2, 3], [-0.5, -1.0, -0.25]), reference, 0.0) == []
    assert _control_failure("x", _Output([1, 2, 3], [-0.5, -1.002, -0.25]), reference, 5e-3) == []
    (drifted,) = _control_failure("x", _Output([1, 2, 3], [-0.5, -1.01, -0.25]), reference, 5e-3)
    assert "0.01 from the reference engine (greedy tokens equal)" in drifted and "platform" in drifted
    (flipped,) = _control_failure("x", _Output([1, 7, 3], [-0.5, -1.0, -0.25]), reference, 5e-3)
    assert "greedy tokens differ" in flipped
