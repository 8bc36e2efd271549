"""Matchness (SWIFT): how often a draft agrees with the full model, teacher-forced.

Matchness is the teacher-forced top-1 agreement between the draft (the model with some sublayers
skipped) and the full model on the full model's own greedy continuation of calibration prompts. It
stands in for the acceptance rate α. Per candidate and sequence it costs one parallel draft pass over
the continuation only: the prompt's keys / values come from the full model, once, as they do in real
self-speculative decoding. Over the continuation the draft reads its own keys / values (SWIFT's
measure). Scoring as decoding with w-token drafts sees it (the full model's keys / values for the
verified text, the draft's own only within its draft) was tried and kept fewer domain sets without
widening τ(knn)/τ(static) (1.02 against 1.07, README history), so it is not offered.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..engine.backbone import Backbone
from ..engine.decode import DecodeConfig
from ..engine.generate import generate
from ..engine.lookup import PromptLookup
from ..engine.skipset import SkipSet
from ..policies.ar import Autoregressive


# --- teacher-forcing data ----------------------------------------------------------------------------
@dataclass(frozen=True)
class MatchData:
    """Teacher-forcing data: each prompt + the full model's greedy continuation."""

    sequences: tuple[tuple[int, ...], ...]   # prompt ids + continuation ids
    starts: tuple[int, ...]                  # index in each sequence where the continuation starts
    targets: tuple[torch.Tensor, ...]        # targets[i][j]: full model's argmax for position starts[i]+j
    # the full model's keys / values for positions 0 .. starts[i]-2 of each sequence, (L, kv, P, hd);
    # empty → recomputed on every call (same numbers, slower)
    prefix_kv: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    def __post_init__(self):
        if not len(self.sequences) == len(self.starts) == len(self.targets):
            raise ValueError("MatchData: sequences, starts and targets must have the same length")
        if self.prefix_kv and len(self.prefix_kv) != len(self.sequences):
            raise ValueError("MatchData: prefix_kv must hold one (keys, values) pair per sequence")
        for seq, s, t in zip(self.sequences, self.starts, self.targets):
            if not 1 <= s < len(seq) or len(t) != len(seq) - s:
                raise ValueError("MatchData: each sequence needs a prompt, a continuation and "
                                 "one target per continuation token")

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def tokens(self) -> int:
        """Number of scored positions (continuation tokens; a target of -1 is not scored)."""
        return sum(int((t >= 0).sum()) for t in self.targets)

    def rows(self) -> list[tuple]:
        """(sequence, start, targets, prefix_kv or None) per sequence."""
        return list(zip(self.sequences, self.starts, self.targets, self.prefix_kv or (None,) * len(self)))

    def with_targets(self, targets) -> "MatchData":
        """The same data scored against other targets (e.g. -1 where a position is not scored)."""
        return MatchData(self.sequences, self.starts, tuple(targets), self.prefix_kv)


def _prefix_kv(backbone: Backbone, seq, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full model's KV for every prompt position but the last (what a real draft reads)."""
    n = start - 1
    cache = backbone.new_cache(max(n, 1))
    if n:
        backbone.forward(seq[:n], cache, SkipSet.empty(), logits="none")
    return cache.k[:, :, :n].clone(), cache.v[:, :, :n].clone()


def _primed_cache(backbone: Backbone, seq, start: int, kv):
    """A cache for the whole sequence holding the full model's prompt KV (positions 0..start-2)."""
    n = start - 1
    cache = backbone.new_cache(len(seq) - 1)
    cache.k[:, :, :n], cache.v[:, :, :n] = kv
    cache.length = n
    return cache


def _draft_argmax(backbone: Backbone, seq, start: int, skip: SkipSet, kv=None, draft=None) -> torch.Tensor:
    """The draft's argmax for each continuation token seq[start:], in one parallel pass.

    As in real self-speculation the draft attends to the full model's KV of the context (the
    prompt, from `kv`) and to its own KV for the tokens it runs itself. It runs positions start-1 .. len-2, whose hidden states predict positions
    start .. len-1 (the last token is never fed). Running the draft over the continuation only, not
    the whole prompt, makes a candidate several times cheaper; and only those rows need the (large)
    lm_head.
    """
    kv = kv if kv is not None else _prefix_kv(backbone, seq, start)
    n = start - 1
    cache = _primed_cache(backbone, seq, start, kv)
    hidden = backbone.forward(seq[n:-1], cache, skip, logits="none", draft=draft)
    with torch.inference_mode():
        logits = F.linear(hidden, backbone.lm_head) if draft is None else draft.head(hidden)
        return logits.argmax(-1)


def build_match_data(backbone: Backbone, prompts: list[str], continuation_tokens: int = 24,
                     max_prompt_tokens: int = 256, progress: bool = True) -> MatchData:
    """Greedy-continue each prompt with the full model and record its teacher-forced targets."""
    if not prompts:
        raise ValueError("build_match_data needs at least one prompt")
    config = DecodeConfig(max_new_tokens=continuation_tokens)
    sequences, starts, targets, kvs = [], [], [], []
    for text in tqdm(prompts, desc="match data", disable=not progress):
        prompt = backbone.encode(text, max_tokens=max_prompt_tokens)
        cont = generate(backbone, prompt, Autoregressive(), config).token_ids
        seq = tuple(prompt.ids) + tuple(cont)
        kv = _prefix_kv(backbone, seq, len(prompt))
        sequences.append(seq)
        starts.append(len(prompt))
        kvs.append(kv)
        # targets from the very computation the drafts use, so that the empty skip set scores
        # exactly 1.0 (incremental and parallel fp32 passes can differ on near-ties)
        targets.append(_draft_argmax(backbone, seq, len(prompt), SkipSet.empty(), kv))
    return MatchData(tuple(sequences), tuple(starts), tuple(targets), tuple(kvs))


def model_drafted_only(data: MatchData) -> MatchData:
    """The same data, scored only where prompt lookup would not draft (`--lookup-aware`).

    With prompt lookup on, a step drafts from the skip set only when the text so far does not end in
    an n-gram seen before; where it does, the lookup's proposal is used and the set does not matter.
    Such positions get target -1 (an argmax never equals it, and `tokens` does not count it), so a
    search over this data optimises the set for the positions it actually drafts.
    """
    targets = []
    for seq, start, target in zip(data.sequences, data.starts, data.targets):
        lookup, kept = PromptLookup(seq[:start]), target.clone()
        for j in range(len(kept)):
            if lookup.propose(1):
                kept[j] = -1
            lookup.extend(seq[start + j:start + j + 1])
        targets.append(kept)
    out = data.with_targets(targets)
    if not out.tokens:
        raise ValueError("model_drafted_only: prompt lookup covers every position; nothing left to score")
    return out


def merge(datas, limit: int | None = None) -> MatchData:
    """Concatenate MatchData, interleaved round-robin so that a `limit` keeps the mix balanced."""
    rows = [row for group in zip_longest(*[d.rows() for d in datas]) for row in group if row is not None]
    if limit is not None:
        rows = rows[:max(1, int(limit))]
    if not rows:
        raise ValueError("merge: no sequences to merge")
    seqs, starts, targets, kvs = zip(*rows)
    # caches are kept only if every part had them (MatchData holds all or none)
    kvs = () if any(kv is None for kv in kvs) else tuple(kvs)
    return MatchData(tuple(seqs), tuple(starts), tuple(targets), kvs)


def _matches(backbone: Backbone, skip: SkipSet, data: MatchData, draft=None) -> int:
    draft = backbone.drafts.for_set(draft, skip)
    return sum(int((_draft_argmax(backbone, seq, s, skip, kv, draft) == t).sum())
               for seq, s, t, kv in data.rows())


def matchness(backbone: Backbone, skip: SkipSet, data: MatchData, draft=None) -> float:
    """Share of continuation positions where the draft's argmax equals the full model's.

    draft: a draft.DraftWeights to score (quantised weights / small head); None → fp32 weights. A set
    that keeps part of each MLP (SkipSet.channels) is scored on that draft's kind cut to its channels.
    """
    skip.validate(backbone.n_layers)
    return _matches(backbone, skip, data, draft) / data.tokens


def matchness_per_domain(backbone: Backbone, skip: SkipSet,
                         data_by_domain: dict[str, MatchData], draft=None) -> dict[str, float]:
    """Matchness of one set on every domain (how well a set transfers: the KNN-SSD argument)."""
    return {name: matchness(backbone, skip, data, draft) for name, data in data_by_domain.items()}
