"""kvengine's own ``generate`` and the model's generation config: the fields it honours are applied as
transformers applies them, the ones it does not are refused by name, never silently ignored."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from kvengine import InvalidRequestError
from kvengine.integrations.hf import Sampling, attach

from .conftest import CHUNK, build_tiny, make_engine, prompt_for


def plain_generate(model, ids: torch.Tensor, enc: torch.Tensor | None, n: int) -> list[int]:
    """Plain transformers greedy generate with the model's generation config (no kvengine)."""
    with torch.no_grad():
        if enc is not None:
            out = model.generate(input_ids=enc[None], decoder_input_ids=ids[None], max_new_tokens=n, do_sample=False)
        else:
            out = model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize(("family", "forced_eos"), [("bart", 2), ("llama", [7, 5])])
def test_forced_eos_token_id_of_the_generation_config_is_applied(family, forced_eos):
    """Regression: kvengine's generate ignored ``generation_config.forced_eos_token_id`` (BART: [24, 24, 24]
    where transformers gives [24, 24, 2]). The last of ``max_new_tokens`` is now forced as transformers
    forces it (a list: the best of its ids), on a miss and on a hit."""
    model = build_tiny(family)
    model.generation_config.forced_eos_token_id = forced_eos
    ids, enc = prompt_for(model, 2 * CHUNK + 3)
    with make_engine() as engine:
        am = attach(model, engine)
        for n in (1, 3, 6):
            want = plain_generate(model, ids, enc, n)
            miss = am.generate(ids, encoder_input_ids=enc, max_new_tokens=n, use_cache=False, store=False)
            hit = am.generate(ids, encoder_input_ids=enc, max_new_tokens=n)
            assert list(miss.new_tokens) == list(hit.new_tokens) == want, n
            assert want[-1] in ([forced_eos] if isinstance(forced_eos, int) else forced_eos)


def test_forced_bos_token_id_of_the_generation_config_is_applied():
    """Regression: ``generation_config.forced_bos_token_id`` was ignored too: after a one-token decoder prompt
    (BART's decoder start) transformers forces it as the first token; kvengine now does the same."""
    model = build_tiny("bart")
    model.generation_config.forced_bos_token_id = 0
    ids, enc = prompt_for(model, 1)
    with make_engine() as engine:
        out = attach(model, engine).generate(ids, encoder_input_ids=enc, max_new_tokens=4)
    want = plain_generate(model, ids, enc, 4)
    assert want[0] == 0 and list(out.new_tokens) == want


def test_forced_tokens_also_bind_sampling():
    """Scenario: under temperature sampling the forced last token is still the forced one (every other
    token has probability 0, as after transformers' processor)."""
    model = build_tiny("llama")
    model.generation_config.forced_eos_token_id = 9
    ids, _ = prompt_for(model, 20)
    with make_engine() as engine:
        out = attach(model, engine).generate(ids, max_new_tokens=5, sampling=Sampling(temperature=1.5, seed=3))
    assert len(out.new_tokens) == 5 and out.new_tokens[-1] == 9


@pytest.mark.parametrize(("field", "value"), [
    ("no_repeat_ngram_size", 3), ("repetition_penalty", 1.3), ("min_new_tokens", 4), ("suppress_tokens", [5]),
    ("num_beams", 4), ("bad_words_ids", [[7]]),
])
def test_a_generation_config_field_it_does_not_honour_is_refused_by_name(field, value):
    """Regression: fields of the generation config that change the tokens transformers picks were silently
    ignored by kvengine's generate. Each is refused by name, before anything is looked up or stored."""
    model = build_tiny("bart")
    setattr(model.generation_config, field, value)
    ids, enc = prompt_for(model, 2 * CHUNK + 3)
    with make_engine() as engine:
        am = attach(model, engine)
        stored = engine.metrics.value("kvengine_stored_chunks_total")
        with pytest.raises(InvalidRequestError, match=re.escape(f"{field}={value!r}") + ".*model.generation_config"):
            am.generate(ids, encoder_input_ids=enc, max_new_tokens=3)
        assert engine.metrics.value("kvengine_stored_chunks_total") == stored
        setattr(model.generation_config, field, None)  # unset: served
        assert len(am.generate(ids, encoder_input_ids=enc, max_new_tokens=3).new_tokens) == 3
