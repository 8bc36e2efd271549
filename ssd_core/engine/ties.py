"""How close a greedy choice was: the top-2 gap of the full model's next-token logits.

Greedy speculative decoding commits exactly the tokens the fp32 verifier picks, but the verifier scores a
token inside a (γ+1)-row pass where plain decoding uses a 1-row pass: the same arithmetic up to
summation order. Where the two best logits are within float rounding of each other (a gap of ~1e-4),
the two passes can pick different tokens and the texts part. `logit_gap` measures that gap at the
first difference, so a report can say "a near-tie" instead of a bare "differ".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-3          # a top-2 gap below this is a floating-point near-tie, not a different choice


@dataclass(frozen=True)
class Gap:
    gap: float              # top-1 logit minus top-2 logit
    top: tuple[int, int]    # the two token ids

    @property
    def near_tie(self) -> bool:
        return self.gap < NEAR_TIE


@torch.inference_mode()
def logit_gap(backbone, prompt_ids, prefix) -> Gap:
    """The full model's top-2 gap for the token after `prompt_ids` + `prefix` (one fresh prefill)."""
    ids = [int(t) for t in prompt_ids] + [int(t) for t in prefix]
    cache = backbone.new_cache(len(ids) + 1)
    logits = backbone.forward(ids, cache, logits="last").float()
    top = torch.topk(logits, 2)
    return Gap(float(top.values[0] - top.values[1]), (int(top.indices[0]), int(top.indices[1])))
