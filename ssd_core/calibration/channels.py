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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..engine.skipset import SkipSet

STATIC = "static"


TOKENS = ("continuation", "all")     # which positions a channel's importance is averaged over
COMPENSATION = ("none", "mean")      # what a cut MLP puts where its dropped channels were (channel_means)


def _activation_stats(bb, data, tokens: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One full-model pass per sequence of `data`, two (layers, channels) float64 means of the MLP
    channels' activations a = silu(g)·u: |a| over the `tokens` rows (channel_importance) and a itself
    over the continuation's rows (channel_means)."""
    if tokens not in TOKENS:
        raise ValueError(f"tokens must be one of {', '.join(TOKENS)}, not {tokens!r}")
    size = (bb.n_layers, bb.layers[0].wdown.shape[1])
    magnitude = torch.zeros(size, dtype=torch.float64, device=bb.device)
    signed = torch.zeros(size, dtype=torch.float64, device=bb.device)
    rows = cont_rows = 0
    with torch.inference_mode():
        for seq, start in zip(data.sequences, data.starts):
            collect: list = []
            bb.forward(seq, bb.new_cache(len(seq)), SkipSet.empty(), logits="none", collect=collect)
            lo = start - 1 if tokens == "continuation" else 0
            for i, kind, h, _ in collect:
                if kind == "mlp":
                    L = bb.layers[i]
                    gate, up = F.linear(F.rms_norm(h[lo:], (bb.hidden,), L.ln2, bb.eps), L.wgu).chunk(2, -1)
                    a = F.silu(gate) * up
                    magnitude[i] += a.abs().sum(0).double()
                    signed[i] += a[start - 1 - lo:].sum(0).double()
            rows += len(seq) - lo
            cont_rows += len(seq) - start + 1
    return magnitude / max(rows, 1), signed / max(cont_rows, 1)


def _weighted(bb, magnitude: torch.Tensor) -> torch.Tensor:
    """Mean |a| times the norm of down's column: the size of what each channel adds to the residual."""
    return (magnitude * torch.stack([L.wdown.norm(dim=0) for L in bb.layers]).double()).float()


def channel_importance(bb, data, tokens: str = "continuation") -> torch.Tensor:
    """(layers, channels): mean |silu(g)·u| · ‖down[:, j]‖ over `data`'s sequences (matchness.MatchData:
    prompt + the full model's continuation), from full-model passes.

    tokens: "continuation" averages over the positions from the prompt's last token on (the rows whose
    outputs are the continuation: what a draft computes while decoding); "all" over every position,
    prompt included. Measured on SmolLM2-135M at keep 0.5 (calibration held-out split, int8 draft):
    own-domain matchness 0.517 against the static set's 0.408 with "continuation", 0.491 against
    0.386 with "all", and the qa set beat the static set on qa only with "continuation" (README).
    """
    return _weighted(bb, _activation_stats(bb, data, tokens)[0])


def channel_means(bb, data) -> torch.Tensor:
    """(layers, channels): each MLP channel's mean activation silu(g)·u over `data`'s continuation rows
    (signed; the rows a draft computes while decoding).

    A cut draft given these (Backbone.set_channel_ranks' means) adds down[:, dropped] @ mean[dropped]
    to every MLP: the dropped channels' average contribution instead of nothing (draft.mlp_weights).
    Only continuation rows: the first positions of a prompt carry activations hundreds of times the
    usual, and a mean over every row made drafts far worse (own-domain matchness 0.15 against 0.57
    uncompensated, keep 0.5, SmolLM2-135M). Measured with the continuation's means at keep 0.5 (window-4
    matchness): own-domain sets 0.569 → 0.597, the static set with the pooled means 0.506 → 0.502; held-out
    mixed stream at γ 4: τ knn 2.35 → 2.40, static 2.15 → 2.17 (README, "The dropped channels' mean").
    """
    return _activation_stats(bb, data, "continuation")[1].float()


def taylor_importance(bb, data, tokens: str = "continuation") -> torch.Tensor:
    """(layers, channels): mean over `data`'s scored continuation rows r of |a_rj · ∂L/∂a_rj|, where a_rj
    is channel j's activation silu(g_j)·u_j at row r and L the summed log-probability of the full
    model's own next tokens (the targets) over the continuation.

    A first-order estimate of how much dropping channel j changes the log-probability of the token the
    draft must propose (the row's own target, so it is specific to what the domain's text predicts),
    where channel_importance measures how much the channel writes whatever it writes. One forward and
    backward pass of transformers' model of the same weights per sequence (calibration only).
    Only continuation rows have a target, so tokens must be "continuation". Measured on SmolLM2-135M at
    keep 0.5 (held-out mixed stream, γ 4): routed sets draft as well as magnitude's (τ 2.32 vs 2.35),
    the pooled static set worse (2.08 vs 2.15), at 3.6× the cost; so magnitude is the default (README).
    """
    if tokens != "continuation":
        raise ValueError(f"taylor importance is measured on the continuation's rows (they have targets), "
                         f"not tokens={tokens!r}")
    hf = bb.hf_model
    acts: dict[int, torch.Tensor] = {}

    def keep_input(i):
        def hook(_module, args):
            args[0].retain_grad()
            acts[i] = args[0]
        return hook

    hooks = [layer.mlp.down_proj.register_forward_pre_hook(keep_input(i))
             for i, layer in enumerate(hf.model.layers)]
    embed = hf.get_input_embeddings().weight
    was = [(p, p.requires_grad) for p in hf.parameters()]
    total = torch.zeros(bb.n_layers, bb.layers[0].wdown.shape[1], dtype=torch.float64)
    count = 0
    try:
        for p, _ in was:
            p.requires_grad_(p is embed)       # one leaf that needs a gradient, so that a graph is built
        for seq, start, target in zip(data.sequences, data.starts, data.targets):
            scored = (target >= 0).to(embed.device)
            rows = slice(start - 1, len(seq) - 1)          # the continuation's rows, as in the logits
            with torch.enable_grad():
                logits = hf(input_ids=torch.tensor([seq], device=embed.device)).logits[0, rows]
                logp = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
                (logp.gather(1, target.clamp(min=0)[:, None].to(embed.device))[:, 0] * scored).sum().backward()
            with torch.no_grad():            # the sums must not join (and keep alive) the graph
                for i, a in acts.items():
                    total[i] += ((a[0, rows] * a.grad[0, rows]).abs() * scored[:, None]).sum(0).double().cpu()
            count += int(scored.sum())
            acts.clear()
            embed.grad = None
    finally:
        for h in hooks:
            h.remove()
        for p, flag in was:
            p.requires_grad_(flag)
    return (total / max(count, 1)).float().to(bb.device)


# how a channel's importance is measured (channel_sets' `importance`)
MEASURES = {"magnitude": channel_importance, "taylor": taylor_importance}
IMPORTANCE = tuple(MEASURES)


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


def channel_sets(bb, data_by_domain: dict, keep: float, progress: bool = True, tokens: str = "continuation",
                 importance: str = "magnitude", compensation: str = "none"):
    """Rankings per domain and pooled (STATIC), and the sets that keep `keep` of each MLP by them
    (tokens: the positions importance is measured on, see channel_importance; importance: IMPORTANCE,
    channel_importance's magnitude or taylor_importance's first-order estimate; compensation:
    COMPENSATION, "mean" also measures every ranking's mean activations, channel_means, the static
    ranking's pooled). Magnitude and the means come from the same passes over the data.

    Returns (ranks {name: (layers, channels) ids}, means {name: (layers, channels)} or None,
    {domain: SkipSet}, static SkipSet).
    """
    from tqdm.auto import tqdm

    if importance not in IMPORTANCE:
        raise ValueError(f"importance must be one of {', '.join(IMPORTANCE)}, not {importance!r}")
    if compensation not in COMPENSATION:
        raise ValueError(f"compensation must be one of {', '.join(COMPENSATION)}, not {compensation!r}")
    imps, means = {}, {}
    for d, data in tqdm(data_by_domain.items(), desc="channel importance", disable=not progress):
        if importance == "magnitude" or compensation == "mean":
            magnitude, means[d] = _activation_stats(bb, data, tokens)
        imps[d] = _weighted(bb, magnitude) if importance == "magnitude" else MEASURES[importance](bb, data, tokens)
    ranks = {d: ranking(v) for d, v in imps.items()}
    ranks[STATIC] = ranking(pooled(imps))
    if compensation == "mean":
        means = {d: m.float() for d, m in means.items()}
        means[STATIC] = pooled_means(means)
    sets = {d: SkipSet(name=d, channels=d, keep=keep) for d in imps}
    return ranks, means if compensation == "mean" else None, sets, SkipSet(name=STATIC, channels=STATIC, keep=keep)
