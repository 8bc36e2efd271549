"""transformers' greedy `model.generate` as an independent reference for the core's own forward."""
from __future__ import annotations

import time

import torch

from ..engine.backbone import Backbone


def hf_greedy_kwargs(backbone: Backbone, max_new_tokens: int) -> dict:
    """`model.generate` arguments for plain greedy decoding that stops exactly where the core does.

    The core stops after the first token in `backbone.eos_ids` (that token included) or after
    max_new_tokens; generate gets the same stop set. A model's own generation_config may carry
    logits processors (repetition penalty, n-gram bans, a minimum length) that plain greedy
    decoding does not have: they are switched off here so the two are comparable.
    """
    eos = sorted(backbone.eos_ids)
    pad = getattr(backbone.tokenizer, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return {"max_new_tokens": max_new_tokens, "do_sample": False, "num_beams": 1,
            "eos_token_id": eos or None, "pad_token_id": pad, "repetition_penalty": 1.0,
            "no_repeat_ngram_size": 0, "min_new_tokens": 0}


def cut_at_eos(ids, eos_ids) -> tuple:
    """Tokens up to and including the first end-of-sequence token (what the core commits)."""
    ids = tuple(int(t) for t in ids)
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[:i + 1]
    return ids


def hf_generate(backbone: Backbone, prompt_ids, max_new_tokens: int) -> dict:
    """Greedy `model.generate` on the same prompt ids, timed (its new tokens, cut at EOS)."""
    ids = torch.tensor([prompt_ids.ids], device=backbone.device)
    with torch.inference_mode():
        backbone.sync()
        t = time.perf_counter()
        out = backbone.hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                         **hf_greedy_kwargs(backbone, max_new_tokens))
        backbone.sync()
        wall = time.perf_counter() - t
    new = cut_at_eos(out[0, ids.shape[1]:].tolist(), backbone.eos_ids)
    return {"new_tokens": len(new), "wall_s": wall, "token_ids": new, "accept_lengths": []}
