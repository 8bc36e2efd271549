"""The core's own forward against transformers' LlamaForCausalLM on the tiny model (fast, unmarked).

The real-model versions of these checks are in test_real_model.py (marked `real`).
"""
import pytest
import torch

from hf_reference import RTOL, compare_forward, hf_greedy, processors_are_plain
from ssd_core.engine.decode import DecodeConfig
from ssd_core.engine.generate import generate
from ssd_core.engine.skipset import SkipSet
from ssd_core.policies.ar import Autoregressive
from ssd_core.policies.static import Static
from tiny import tiny_backbone

PROMPTS = ["Translate German to English: Guten Morgen, wie geht es dir?",
           "Summarize: The council met on Monday and agreed to repair the old bridge.",
           "x"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_forward_logits_match_transformers(tiny, prompt):
    """Prefill (T > 1), single tokens (T = 1, no mask) and a cropped multi-token verify, vs transformers."""
    worst = compare_forward(tiny, tiny.encode(prompt), steps=12, verify_len=5,
                            draft_skip=SkipSet(frozenset({1, 3}), frozenset({2})))
    assert worst <= RTOL


def test_tiny_logits_are_not_trivially_small(tiny):
    """The tolerance is relative to max(1, |logit|): make sure it is not vacuous on the tiny model."""
    ids = torch.tensor([tiny.encode(PROMPTS[0]).ids])
    with torch.inference_mode():
        logits = tiny.hf_model(input_ids=ids).logits[0]
    assert float(logits.abs().max()) > 1.0
    assert float(logits[-1].softmax(-1).max()) < 0.999            # not one-hot: argmax ties would matter


def test_greedy_decoding_matches_transformers_generate(tiny):
    """AR and a speculative strategy equal transformers' greedy generate, EOS handling included."""
    assert processors_are_plain(tiny)
    cfg = DecodeConfig(max_new_tokens=40, gamma=3)
    for prompt in PROMPTS:
        ids = tiny.encode(prompt)
        ref = hf_greedy(tiny, ids, 40)
        ar = generate(tiny, ids, Autoregressive(), cfg)
        spec = generate(tiny, ids, Static(SkipSet(frozenset({1, 3}), frozenset({2}))), cfg)
        assert ar.token_ids == ref, prompt
        assert spec.token_ids == ref, prompt


def test_eos_is_handled_like_transformers():
    """Force an early EOS: both stop right after it, the EOS token included, nothing after."""
    tiny = tiny_backbone()           # its own copy: the lm_head is edited below
    eos = next(iter(tiny.eos_ids))
    ids = tiny.encode(PROMPTS[1])
    free = hf_greedy(tiny, ids, 8)
    assert eos not in free
    # make EOS the greedy choice after the third new token by biasing the lm_head row (shared by both)
    head = tiny.hf_model.lm_head.weight
    assert head.data_ptr() == tiny.lm_head.data_ptr()
    with torch.no_grad():
        head.data[eos] = head.data[free[2]] * 1.5
    tiny.weights_changed()           # the verifier's prepacked copy (oneDNN kernel) is made again
    ref = hf_greedy(tiny, ids, 20)
    got = generate(tiny, ids, Autoregressive(), DecodeConfig(max_new_tokens=20)).token_ids
    assert ref[-1] == eos and len(ref) < 20
    assert got == ref
