"""Per-domain MLP channel rankings: which intermediate neurons of each MLP a domain's prompts use.

A SkipSet with `channels` (engine/skipset.py) drafts with only the top `keep` share of every MLP's
channels under one of these rankings. A channel j of layer i is one intermediate neuron: rows j of
gate and up, column j of down. Its importance on a set of texts is the mean over their tokens of
|silu(gate_j) · up_j| times the norm of down's column j, the size of what it adds to the residual
stream. The full model computes it on the calibration prompts and its own continuations of them
(the text a draft drafts).

Why a finer grain than whole sublayers: on SmolLM2-135M a domain's skip set of whole sublayers
barely beat one static set on that domain (README), while which neurons fire differs by domain.
Measured with `python -m ssd_core.calibrate --search-mode channels` (README, "Channel sets").

Settled choices (each measured against the alternative on SmolLM2-135M, keep 0.5, int8 draft; the
alternatives were removed, the README's history keeps the numbers): importance over the
continuation's rows, not every row (own-domain held-out matchness 0.517 vs 0.491, and only then does
qa's set beat the static one); by magnitude, not Taylor |activation × gradient| (routed sets τ 2.35 vs
2.32, a worse pooled static set, 3.6× the cost); dropped channels replaced by their mean, not by
nothing (τ knn 2.35 → 2.40, static 2.15 → 2.17 on the held-out mixed stream at γ 4).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..engine.skipset import SkipSet

STATIC = "static"


def _activation_stats(bb, data) -> tuple[torch.Tensor, torch.Tensor]:
    """One full-model pass per sequence of `data`, two (layers, channels) float64 means of the MLP
    channels' activations a = silu(g)·u over the continuation's rows: |a| (channel_importance) and a
    itself (channel_means)."""
    size = (bb.n_layers, bb.layers[0].wdown.shape[1])
    magnitude = torch.zeros(size, dtype=torch.float64, device=bb.device)
    signed = torch.zeros(size, dtype=torch.float64, device=bb.device)
    rows = 0
    with torch.inference_mode():
        for seq, start in zip(data.sequences, data.starts):
            collect: list = []
            bb.forward(seq, bb.new_cache(len(seq)), SkipSet.empty(), logits="none", collect=collect)
            lo = start - 1                  # the rows whose outputs are the continuation
            for i, kind, h, _ in collect:
                if kind == "mlp":
                    L = bb.layers[i]
                    gate, up = F.linear(F.rms_norm(h[lo:], (bb.hidden,), L.ln2, bb.eps), L.wgu).chunk(2, -1)
                    a = F.silu(gate) * up
                    magnitude[i] += a.abs().sum(0).double()
                    signed[i] += a.sum(0).double()
            rows += len(seq) - lo
    return magnitude / max(rows, 1), signed / max(rows, 1)


def _weighted(bb, magnitude: torch.Tensor) -> torch.Tensor:
    """Mean |a| times the norm of down's column: the size of what each channel adds to the residual."""
    return (magnitude * torch.stack([L.wdown.norm(dim=0) for L in bb.layers]).double()).float()


def channel_importance(bb, data) -> torch.Tensor:
    """(layers, channels): mean |silu(g)·u| · ‖down[:, j]‖ over `data`'s continuation rows (matchness.MatchData:
    prompt + the full model's continuation; the rows from the prompt's last token on, whose outputs are
    the continuation: what a draft computes while decoding), from full-model passes."""
    return _weighted(bb, _activation_stats(bb, data)[0])


def channel_means(bb, data) -> torch.Tensor:
    """(layers, channels): each MLP channel's mean activation silu(g)·u over `data`'s continuation rows
    (signed; the rows a draft computes while decoding).

    A cut draft given these (DraftFactory.install's means) adds down[:, dropped] @ mean[dropped]
    to every MLP: the dropped channels' average contribution instead of nothing (drafts.mlp_weights).
    Only continuation rows: the first positions of a prompt carry activations hundreds of times the
    usual, and a mean over every row made drafts far worse (own-domain matchness 0.15 against 0.57
    uncompensated, keep 0.5, SmolLM2-135M).
    """
    return _activation_stats(bb, data)[1].float()


def pooled(importances: dict[str, torch.Tensor]) -> torch.Tensor:
    """One importance for every domain at once (the static ranking): each domain's, normalised per
    layer to sum 1, summed, so that every domain weighs the same whatever its text lengths."""
    if not importances:
        raise ValueError("pooled: no importances")
    return sum(v / v.sum(1, keepdim=True).clamp(min=1e-30) for v in importances.values())


def pooled_means(means: dict[str, torch.Tensor]) -> torch.Tensor:
    """The static ranking's mean activations: the domains' means averaged, every domain alike."""
    if not means:
        raise ValueError("pooled_means: no means")
    return sum(means.values()) / len(means)


def ranking(importance: torch.Tensor) -> torch.Tensor:
    """Each layer's channel ids, most important first (ties by id)."""
    return torch.argsort(-importance, dim=1, stable=True)


def channel_sets(bb, data_by_domain: dict, keep: float, progress: bool = True):
    """Rankings and mean activations per domain and pooled (STATIC), and the sets that keep `keep` of
    each MLP by them. Importance and means come from the same passes over the data.

    Returns (ranks {name: (layers, channels) ids}, means {name: (layers, channels)},
    {domain: SkipSet}, static SkipSet).
    """
    imps, means = {}, {}
    for d, data in tqdm(data_by_domain.items(), desc="channel importance", disable=not progress):
        magnitude, signed = _activation_stats(bb, data)
        imps[d], means[d] = _weighted(bb, magnitude), signed.float()
    ranks = {d: ranking(v) for d, v in imps.items()}
    ranks[STATIC] = ranking(pooled(imps))
    means[STATIC] = pooled_means(means)
    sets = {d: SkipSet(name=d, channels=d, keep=keep) for d in imps}
    return ranks, means, sets, SkipSet(name=STATIC, channels=STATIC, keep=keep)
