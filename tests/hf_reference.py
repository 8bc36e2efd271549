"""transformers as an independent reference for the core's own forward and greedy decoding.

Nothing here uses ssd_core's generation code: the references come straight from
`backbone.hf_model` (the LlamaForCausalLM the core's weights were copied from).
"""
from __future__ import annotations

import inspect

import torch
from ssd_core.engine.backbone import EMPTY

# |ours − transformers| ≤ RTOL · max(1, max |logit|) at every position (fp32 both sides).
RTOL = 1e-4


def hf_greedy(bb, prompt_ids, max_new_tokens: int) -> tuple[int, ...]:
    """transformers' greedy `generate`, stopped by the same EOS set as the core, cut after EOS.

    Batch of one, attention mask of ones; the model's generation_config has no logits processors
    for the models used here (checked by the caller through `processors_are_plain`).
    """
    ids = torch.tensor([list(prompt_ids.ids)])
    eos = sorted(bb.eos_ids)
    with torch.inference_mode():
        out = bb.hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                   max_new_tokens=max_new_tokens, eos_token_id=eos,
                                   pad_token_id=eos[0] if eos else 0)
    new = [int(t) for t in out[0, ids.shape[1]:]]
    for i, t in enumerate(new):
        if t in bb.eos_ids:
            assert all(x == (eos[0] if eos else 0) for x in new[i + 1:])   # padding only after EOS
            return tuple(new[:i + 1])
    return tuple(new)


def processors_are_plain(bb) -> bool:
    """No repetition penalty, n-gram ban or minimum length hides in the model's generation_config."""
    g = bb.hf_model.generation_config
    return ((g.repetition_penalty in (None, 1.0)) and not g.no_repeat_ngram_size
            and not g.min_new_tokens and not g.min_length and not g.bad_words_ids
            and not g.suppress_tokens and not g.begin_suppress_tokens and not g.sequence_bias
            and g.num_beams in (None, 1))


def _cached_call(hf, ids: list[int], total_len: int, past):
    """One transformers forward with its KV cache (`cache` in transformers ≥ 5.2x, else
    `past_key_values`); returns (last-position logits, the cache)."""
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    kw = {} if past is None else {name: past}
    with torch.inference_mode():
        out = hf(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, total_len, dtype=torch.long),
                 use_cache=True, **kw)
    past = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
    assert past is not None, "transformers returned no KV cache"
    return out.logits[0, -1].float(), past


def _hf_full(bb, seq: list[int]) -> torch.Tensor:
    """Logits of a full, uncached transformers forward over `seq`: (len(seq), vocab)."""
    ids = torch.tensor([seq])
    with torch.inference_mode():
        return bb.hf_model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0].float()


def _check(ours: torch.Tensor, ref: torch.Tensor, what: str, worst: list) -> None:
    ours, ref = ours.float().reshape(ref.shape), ref.float()
    err = float((ours - ref).abs().max())
    scale = max(1.0, float(ref.abs().max()))
    worst.append((err / scale, what))
    assert err <= RTOL * scale, f"{what}: max |ours − transformers| = {err:.3g} (logit scale {scale:.3g})"


def compare_forward(bb, prompt_ids, steps: int = 12, verify_len: int = 4, draft_skip=None,
                    full_every: int = 4) -> float:
    """Walk the core's forward against transformers; return the worst relative error seen.

    1. prefill (T > 1, causal mask) vs an uncached transformers forward, every position;
    2. `steps` single tokens (T = 1, mask None) vs transformers with its own KV cache
       (`past_key_values`), and every `full_every`-th one also vs an uncached forward over the
       whole sequence;
    3. the decode loop's verification pattern: draft `verify_len − 1` tokens with `draft_skip`
       (writes KV for some layers only), crop the cache back, then verify `verify_len` tokens at
       once (T > 1 at an offset) vs the uncached forward's last rows.
    """
    worst: list = []
    seq = list(prompt_ids.ids)
    cache = bb.new_cache(len(seq) + steps + 2 * verify_len + 2)
    hf = bb.hf_model

    ours = bb.forward(seq, cache, EMPTY, logits="all")
    ref_full = _hf_full(bb, seq)
    _check(ours, ref_full, "prefill (all positions)", worst)

    _, past = _cached_call(hf, seq, len(seq), None)
    nxt = int(ours[-1].argmax())
    for i in range(steps):
        ours = bb.forward([nxt], cache, EMPTY, logits="last")
        seq.append(nxt)
        ref, past = _cached_call(hf, [nxt], len(seq), past)
        _check(ours, ref, f"single token {i} (cached transformers)", worst)
        if i % full_every == full_every - 1:
            _check(ours, _hf_full(bb, seq)[-1], f"single token {i} (uncached transformers)", worst)
        nxt = int(ours.argmax())

    # verification: draft with a skip set (stale KV past the committed length), crop, verify
    n = cache.length
    drafts, x = [], nxt
    for _ in range(verify_len - 1):
        x = int(bb.forward([x], cache, draft_skip or EMPTY, logits="last").argmax())
        drafts.append(x)
    cache.crop(n)
    block = [nxt] + drafts
    ours = bb.forward(block, cache, EMPTY, logits="all")
    _check(ours, _hf_full(bb, seq + block)[-len(block):], f"verify of {len(block)} tokens at {n}", worst)
    return max(w for w, _ in worst)
