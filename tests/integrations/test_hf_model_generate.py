"""The model's own ``generate`` over a cache kvengine prefilled (``AttachedModel.model_generate``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvengine import InvalidRequestError, UnsupportedModelError
from kvengine.integrations.hf import attach

from .conftest import CHUNK, FAST_FAMILIES, SLOW_FAMILIES, build_tiny, make_engine, prompt_for

#: Refused by model_generate (measured: see _MODEL_GENERATE_REFUSED): encoder-decoder and Mamba2.
REFUSED = ("t5", "bart", "mamba2")
SUPPORTED = [f for f in FAST_FAMILIES if f not in REFUSED]


@pytest.mark.parametrize("family", [*SUPPORTED, *(pytest.param(f, marks=pytest.mark.slow) for f in SLOW_FAMILIES)])
def test_outputs_equal_a_plain_model_generate_on_a_miss_and_on_a_hit(family):
    """Every family but the refused ones: the first call (a miss) stores the prompt's full chunks; a second request
    sharing that prefix reuses them; both produce exactly the sequences and scores of a plain
    ``model.generate`` with the same arguments."""
    model = build_tiny(family)
    ids, _ = prompt_for(model, 3 * CHUNK + 5, seed=31)
    longer = torch.cat([ids, prompt_for(model, CHUNK + 3, seed=32)[0]])
    kw = dict(max_new_tokens=10, do_sample=False, output_scores=True, return_dict_in_generate=True)
    with make_engine() as engine:
        am = attach(model, engine)
        for prompt, reused in ((ids, 0), (longer, 3 * CHUNK)):
            plain = model.generate(prompt[None], **kw)
            run = am.model_generate(prompt, **kw)
            assert run.load_ok and run.reused_tokens == reused
            assert torch.equal(run.output.sequences, plain.sequences)
            assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(run.output.scores, plain.scores))
            assert run.stored_chunks > 0 or reused


def test_generation_config_processors_and_stopping_criteria_apply(tiny_llama):
    """What ``generate`` supports applies unchanged on a hit: a generation config with sampling settings,
    a logits processor banning a token, a stopping criterion, and a streamer; the sampled sequence equals a
    plain generate's under the same seed."""
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
    from transformers.generation.logits_process import SuppressTokensLogitsProcessor
    from transformers.generation.stopping_criteria import MaxLengthCriteria
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self) -> None:
            self.got: list[int] = []

        def put(self, value: torch.Tensor) -> None:
            self.got += value.reshape(-1).tolist()

        def end(self) -> None:
            pass

    ids, _ = prompt_for(tiny_llama, 2 * CHUNK + 7, seed=33)
    banned = 5
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, max_new_tokens=30)
    stop = len(ids) + 9

    def kwargs() -> dict:
        return dict(generation_config=config, logits_processor=LogitsProcessorList(
            [SuppressTokensLogitsProcessor([banned])]), stopping_criteria=StoppingCriteriaList([
                MaxLengthCriteria(stop)]))

    with make_engine() as engine:
        am = attach(tiny_llama, engine)
        am.model_generate(ids, max_new_tokens=1, do_sample=False)  # stores the prompt
        torch.manual_seed(7)
        plain = tiny_llama.generate(ids[None], **kwargs())
        torch.manual_seed(7)
        streamer = Collect()
        run = am.model_generate(ids, streamer=streamer, return_dict_in_generate=False, **kwargs())
    assert run.reused_tokens == 2 * CHUNK
    assert torch.equal(run.output, plain)
    assert len(run.new_tokens) == 9 and banned not in run.new_tokens
    assert streamer.got[len(ids):] == list(run.new_tokens)


@pytest.mark.parametrize("family", REFUSED)
def test_refused_families_say_why_and_point_to_generate(family):
    """Encoder-decoder models and Mamba2 are refused by model_generate, naming the measured reason and the
    exact alternative (AttachedModel.generate)."""
    model = build_tiny(family)
    ids, _ = prompt_for(model, CHUNK + 3, seed=35)
    with make_engine() as engine:
        am = attach(model, engine)
        with pytest.raises(UnsupportedModelError, match="model_generate is refused: .*use AttachedModel.generate"):
            am.model_generate(ids, max_new_tokens=2)


def test_inference_mode_and_refusals(tiny_llama):
    """Under ``torch.inference_mode()`` the prefix is still reused; passing a cache is refused with a
    clear error."""
    ids, _ = prompt_for(tiny_llama, 2 * CHUNK + 3, seed=34)
    with make_engine() as engine, torch.inference_mode():
        am = attach(tiny_llama, engine)
        am.model_generate(ids, max_new_tokens=1, do_sample=False)
        again = am.model_generate(ids, max_new_tokens=3, do_sample=False)
        assert again.reused_tokens == 2 * CHUNK and again.load_ok
        with pytest.raises(InvalidRequestError, match="past_key_values"):
            am.model_generate(ids, past_key_values=None)
