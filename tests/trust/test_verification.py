"""Verification records: stable serialisation, digest and seal, and exact matching (no engine, no model)."""

from __future__ import annotations

import dataclasses
import json

from kvengine.trust.verification import (
    GroupVerdict,
    Outcome,
    Platform,
    Refusal,
    VerificationRecord,
    check_record,
    cpu_description,
    find_matching,
    record_name,
    serialise,
    write_record,
)

SECRET = b"s" * 32
PLATFORM = Platform(accelerator="cpu", accelerator_model="Test CPU", isa_flags=("avx512f", "avx2"),
                    torch_version="2.0", engine="hf", engine_version="5.0", attention_backend="sdpa",
                    kv_dtype="float32", kv_layout_id="layout-1", block_size=16)
RECORD = VerificationRecord(platform=PLATFORM, kvengine_version="1.0", model="m", model_fingerprint="fp",
                            groups=(GroupVerdict(group="group 0", outcome=Outcome.EXACT, max_state_error=0.0,
                                                 max_logprob_error=0.0, max_logit_error=0.0, tokens_loaded=32),),
                            date="2025-01-01T00:00:00+00:00")


def test_serialisation_is_stable_and_round_trips():
    """Scenario: the same record is the same bytes; its body parses back to an equal record."""
    assert serialise(RECORD, SECRET) == serialise(dataclasses.replace(RECORD), SECRET)
    body = json.loads(serialise(RECORD))["record"]
    assert VerificationRecord.from_body(body) == RECORD
    assert PLATFORM.isa_flags == ("avx2", "avx512f")  # sorted: order of detection does not matter


def test_written_record_is_found_only_for_its_exact_platform_model_and_version(tmp_path):
    """Scenario: any one platform field, the model or the version changed: no record."""
    write_record(tmp_path, RECORD, SECRET)
    assert find_matching(tmp_path, PLATFORM, "fp", "1.0", SECRET) == RECORD
    for field, value in [("accelerator_model", "Other"), ("isa_flags", ("avx2",)), ("torch_version", "2.1"),
                         ("engine_version", "5.1"), ("kv_layout_id", "x"), ("block_size", 32),
                         ("tensor_parallel_size", 2), ("attention_backend", None)]:
        assert find_matching(tmp_path, dataclasses.replace(PLATFORM, **{field: value}), "fp", "1.0", SECRET) is None
    assert find_matching(tmp_path, PLATFORM, "other", "1.0", SECRET) is None
    assert find_matching(tmp_path, PLATFORM, "fp", "1.1", SECRET) is None


def test_edits_unsealed_records_and_other_secrets_are_refused_with_the_reason(tmp_path):
    """Scenario: an edited record fails its digest; an unsealed one is refused when a secret is set; one sealed
    under another secret fails its seal; a record planted under another platform's name is refused."""
    path = tmp_path / record_name(PLATFORM, "fp", "1.0")
    data = json.loads(serialise(RECORD, SECRET))
    data["record"]["groups"][0]["tokens_loaded"] = 99
    path.write_text(json.dumps(data))
    assert check_record(path, PLATFORM, "fp", "1.0", SECRET).refusal is Refusal.DIGEST
    path.write_bytes(serialise(RECORD))
    assert check_record(path, PLATFORM, "fp", "1.0", SECRET).refusal is Refusal.UNSEALED
    assert check_record(path, PLATFORM, "fp", "1.0", None).record == RECORD
    path.write_bytes(serialise(RECORD, b"t" * 32))
    assert check_record(path, PLATFORM, "fp", "1.0", SECRET).refusal is Refusal.SEAL
    other = dataclasses.replace(RECORD, platform=dataclasses.replace(PLATFORM, accelerator_model="Other"))
    path.write_bytes(serialise(other, SECRET))
    check = check_record(path, PLATFORM, "fp", "1.0", SECRET)
    assert check.refusal is Refusal.PLATFORM and "accelerator_model" in check.detail


def test_a_record_that_was_not_exact_unlocks_nothing(tmp_path):
    """Scenario: a (validly sealed) record with a DIFFERS group or no tokens loaded is refused."""
    bad = dataclasses.replace(RECORD, groups=(dataclasses.replace(RECORD.groups[0], tokens_loaded=0),))
    write_record(tmp_path, bad, SECRET)
    assert find_matching(tmp_path, PLATFORM, "fp", "1.0", SECRET) is None


def test_unsafe_and_malformed_files_are_refused(tmp_path):
    """Scenario: a FIFO, a symbolic link or non-JSON under the record's name is refused, never read or followed."""
    import os

    path = tmp_path / record_name(PLATFORM, "fp", "1.0")
    os.mkfifo(path)
    assert check_record(path, PLATFORM, "fp", "1.0", None).refusal is Refusal.UNREADABLE
    path.unlink()
    (tmp_path / "real.json").write_bytes(serialise(RECORD))
    path.symlink_to(tmp_path / "real.json")
    assert check_record(path, PLATFORM, "fp", "1.0", None).refusal is Refusal.UNREADABLE
    path.unlink()
    path.write_text("{not json")
    assert check_record(path, PLATFORM, "fp", "1.0", None).refusal is Refusal.UNREADABLE


def test_cpu_description_reads_the_model_name_and_isa_flags():
    """Scenario: /proc/cpuinfo's model name and the kernel-relevant flags, nothing else."""
    text = "processor: 0\nmodel name\t: Xeon Test\nflags\t\t: fpu sse avx2 avx512f amx_tile\n"
    assert cpu_description(text) == ("Xeon Test", ("avx2", "avx512f", "amx_tile"))
