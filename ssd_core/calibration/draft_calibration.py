"""Calibration of the cheap drafts (draft.py): the small draft head and each draft kind's acceptance.

Small head (FR-Spec): the model greedily continues the calibration prompts of every domain; tokens
it emits rank first (by count), then tokens of the prompts, then the rest in id order (a BPE
vocabulary's ids follow its merge order, roughly its frequency order). The head is the smallest size
from HEAD_SIZES whose tokens cover `coverage` of what the model emits on the held-out prompts.

Acceptance per draft kind: teacher-forced top-1 agreement (matchness) of every calibrated skip set,
and of the bare draft (nothing skipped), on held-out prompts, measured with the draft's own weights
and head. `auto`, the adaptive draft length and the predicted speedups start from these numbers.
"""
from __future__ import annotations

import statistics

import torch
from tqdm.auto import tqdm

from ..engine.decode import DecodeConfig
from ..engine.draft import DRAFT_KINDS, frequent_tokens
from ..engine.generate import generate
from ..engine.skipset import SkipSet
from ..policies.static import Static
from .domains import split
from .matchness import build_match_data, matchness

HEAD_SIZES = (2048, 4096, 8192, 16384, 32768)
FULL = "full"                     # the acceptance key of the bare draft (no sublayer skipped)


def _continuation(bb, text: str, tokens: int, max_prompt_tokens: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    prompt = bb.encode(text, max_tokens=max_prompt_tokens)
    # the int8 self-draft is lossless and faster than plain decoding: same tokens, less waiting
    cfg = DecodeConfig(max_new_tokens=tokens, draft="int8", small_head=False, lookup=True)
    return prompt.ids, generate(bb, prompt, Static(SkipSet.empty()), cfg).token_ids


def choose_head(bb, calibration_prompts: list[str], held_out_prompts: list[str], tokens: int = 32,
                coverage: float = 0.99, max_prompt_tokens: int = 256, progress: bool = True) -> dict:
    """The small draft head: token ids, size and the held-out coverage of every candidate size."""
    counts = torch.zeros(bb.vocab, dtype=torch.float64)
    bar = tqdm(total=len(calibration_prompts) + len(held_out_prompts), desc="draft head",
               disable=not progress)
    for text in calibration_prompts:
        prompt_ids, out = _continuation(bb, text, tokens, max_prompt_tokens)
        counts.index_add_(0, torch.tensor(out, dtype=torch.long), torch.full((len(out),), 1000.0,
                                                                            dtype=torch.float64))
        counts.index_add_(0, torch.tensor(prompt_ids, dtype=torch.long),
                          torch.ones(len(prompt_ids), dtype=torch.float64))
        bar.update()
    held: list[int] = []
    for text in held_out_prompts:
        held.extend(_continuation(bb, text, tokens, max_prompt_tokens)[1])
        bar.update()
    bar.close()
    always = sorted(bb.eos_ids)
    by_size = {}
    choice = None
    for size in [s for s in HEAD_SIZES if s < bb.vocab]:
        ids = set(frequent_tokens(counts, size, always))
        cov = sum(t in ids for t in held) / max(1, len(held))
        by_size[size] = round(cov, 4)
        if choice is None and cov >= coverage:
            choice = size
    if choice is None:
        return {"ids": None, "size": bb.vocab, "coverage": 1.0, "coverage_by_size": by_size,
                "held_out_tokens": len(held)}
    return {"ids": frequent_tokens(counts, choice, always), "size": choice, "coverage": by_size[choice],
            "coverage_by_size": by_size, "held_out_tokens": len(held)}


def draft_acceptance(bb, sets: dict[str, SkipSet], data: dict, kinds=DRAFT_KINDS,
                     progress: bool = True) -> dict[str, dict[str, float]]:
    """kind → set name → held-out matchness on its own domain (static and 'full': mean over domains).

    data: domain → matchness.MatchData of held-out prompts (the full model's continuations).
    """
    out: dict[str, dict[str, float]] = {}
    for kind in kinds:
        draft = bb.drafts.get(kind)
        per = {}
        for name, skip in [*sets.items(), (FULL, SkipSet.empty())]:
            domains = [name] if name in data else list(data)
            per[name] = round(statistics.fmean(matchness(bb, skip, data[d], draft) for d in domains), 4)
        out[kind] = per
        if progress:
            print(f"draft acceptance ({kind}): {per}", flush=True)
    return out


def held_out_data(bb, prompts: dict[str, list[str]], per_domain: int = 2, continuation_tokens: int = 24,
                  max_prompt_tokens: int = 256) -> dict:
    """Teacher-forcing data on the first held-out prompts of every domain (domains.split)."""
    return {d: build_match_data(bb, split(p)[1][:per_domain], continuation_tokens, max_prompt_tokens,
                                progress=False) for d, p in prompts.items()}


def head_for_domains(bb, prompts: dict[str, list[str]], per_domain: int = 4, held_out_per_domain: int = 2,
                     max_prompt_tokens: int = 256, progress: bool = True) -> dict:
    """choose_head on the calibration / held-out split of the domain prompts; installs it on `bb`."""
    parts = {d: split(p) for d, p in prompts.items()}
    head = choose_head(bb, [p for c, _ in parts.values() for p in c[:per_domain]],
                       [p for _, h in parts.values() for p in h[:held_out_per_domain]],
                       max_prompt_tokens=max_prompt_tokens, progress=progress)
    bb.drafts.set_head(head["ids"])
    return head
