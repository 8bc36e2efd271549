"""The draft-weights factory: what a draft pass reads for a given skip set.

Every cheap-draft idea sits behind this one seam, so the forward, the skip set and the decode loop
need not know them: the draft kind (int8 / fp32, draft.py), the calibration's small draft head
(FR-Spec), and channel sets. A channel set (SkipSet.channels) keeps only the top `keep` share of
every MLP's channels (intermediate neurons) under a ranking measured at calibration
(calibration/channels.py); the rest are replaced by their mean output, a constant bias. The factory
holds the rankings and means a calibration installed, builds each draft once (≈ 0.6 s for int8 on
2 cores) and shares it between sessions.
"""
from __future__ import annotations

import copy
import threading

import torch

from .draft import DraftLayer, DraftWeights, pack_int8
from .machine import release_freed_memory
from .skipset import SkipSet


def mlp_weights(layer, kept: torch.Tensor, mean: torch.Tensor | None = None):
    """A layer's fused gate/up and down weights, cut to the `kept` MLP channels, and the down bias.

    A channel j is row j of gate and of up and column j of down: one intermediate neuron. Leaving it
    out removes its term silu(g_j)·u_j·down[:, j] from the MLP's output. mean: the layer's mean
    activation per channel (calibration/channels.py: channel_means); given, the dropped channels'
    terms are replaced by their mean, down[:, dropped] @ mean[dropped], a constant bias (None without).
    """
    n = layer.wgu.shape[0] // 2
    bias = None
    if mean is not None:
        dropped = torch.ones(n, dtype=torch.bool, device=kept.device)
        dropped[kept] = False
        bias = (layer.wdown[:, dropped].double() @ mean[dropped].double()).to(layer.wdown.dtype)
    return (torch.cat([layer.wgu[kept], layer.wgu[n + kept]]).contiguous(),
            layer.wdown[:, kept].contiguous(), bias)


def cut_draft(draft: DraftWeights, backbone, kept: list, name: tuple[str, float],
              means: torch.Tensor | None = None) -> DraftWeights:
    """`draft` with every MLP cut to the `kept` channel ids of its layer (DraftFactory.kept_channels).

    The head and the attention weights are the draft's own objects, shared; only the MLPs are made
    anew (cut from the fp32 weights, then packed as the draft's kind packs). name: the (ranking,
    keep) the label shows. means: (layers, channels) mean activations; given, each MLP adds its
    dropped channels' mean output as a bias (mlp_weights), and the label says so.
    """
    if len(kept) != backbone.n_layers:
        raise ValueError(f"kept: one id list per layer ({backbone.n_layers}), got {len(kept)}")
    cuts = [mlp_weights(layer, k, None if means is None else means[i])
            for i, (layer, k) in enumerate(zip(backbone.layers, kept))]
    int8 = draft.kind == "int8"
    mlps = [(gu, down) for gu, down, _ in cuts]
    if int8:
        packed = pack_int8([job for gu, down, b in cuts for job in ((gu, None), (down, b))], draft.kernel)
        mlps = list(zip(packed[0::2], packed[1::2]))
    out = copy.copy(draft)
    out.channels = name
    out.compensated = means is not None
    out.layers = [DraftLayer(d, [d.wqkv, d.wo, *mlps[i]], cuts[i][2])
                  for i, d in enumerate(draft.layers)]
    return out


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(torch.as_tensor(a).cpu().float(), torch.as_tensor(b).cpu().float())


class DraftFactory:
    """The draft weights of one Backbone, built on first use and cached (thread-safe)."""

    def __init__(self, backbone):
        self._bb = backbone
        # DraftWeights' int8_kernel (None: PyTorch's int8 CPU kernel exactly when the model is on the CPU;
        # tests set False to run the dequantised path a device without that kernel (CUDA) takes)
        self.int8_kernel: bool | None = None
        self.head_ids: tuple[int, ...] | None = None            # the calibration's small draft head
        self.channel_ranks: dict[str, torch.Tensor] = {}       # name → (layers, channels) ids, best first
        self.channel_means: dict[str, torch.Tensor] = {}       # name → (layers, channels) mean activations
        self._built: dict = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Forget every built draft (after the weights changed, or a setting of the factory did)."""
        with self._lock:
            self._built = {}

    def set_head(self, ids) -> None:
        """Install the small draft head's token ids (from a calibration); None → the full vocabulary."""
        ids = None if ids is None else tuple(sorted({int(i) for i in ids}))
        with self._lock:
            if ids != self.head_ids:
                self.head_ids = ids
                self._built = {k: v for k, v in self._built.items() if not k[1]}

    def install_channels(self, ranks: dict | None, means: dict | None = None) -> None:
        """Install a calibration's MLP channel rankings ({name: (layers, channels) ids}) and, for the
        rankings whose cut drafts add their dropped channels' mean, those means; None → none."""
        bb = self._bb
        ranks = {str(k): torch.as_tensor(v, dtype=torch.long, device=bb.device) for k, v in (ranks or {}).items()}
        means = {str(k): torch.as_tensor(v, dtype=bb.dtype, device=bb.device) for k, v in (means or {}).items()}
        inter = bb.layers[0].wdown.shape[1]
        for what, table in (("ranking", ranks), ("mean activations", means)):
            for name, r in table.items():
                if r.shape != (bb.n_layers, inter):
                    raise ValueError(f"channel {what} {name!r} has shape {tuple(r.shape)}; this model needs "
                                     f"({bb.n_layers}, {inter})")
        if set(means) - set(ranks):
            raise ValueError(f"mean activations for rankings that are not installed: {sorted(set(means) - set(ranks))}")
        with self._lock:
            self.channel_ranks, self.channel_means = ranks, means
            self._built = {k: v for k, v in self._built.items() if k[2] is None}

    def add_channels(self, ranks: dict | None, means: dict | None = None) -> None:
        """Add another calibration's channel rankings beside the installed ones (several calibrations
        served at once). A name already installed must hold the same ranking and means: else
        ValueError, and nothing is added."""
        ranks, means = ranks or {}, means or {}
        old_ranks, old_means = self.channel_ranks, self.channel_means
        for name, r in ranks.items():
            if name in old_ranks and not (torch.equal(old_ranks[name].cpu(), torch.as_tensor(r, dtype=torch.long))
                                          and _same(old_means.get(name), means.get(name))):
                raise ValueError(f"its MLP channel ranking {name!r} differs from the one of that name "
                                 "already installed")
        self.install_channels({**old_ranks, **ranks}, {**old_means, **means})

    def memory(self) -> dict[str, int]:
        """Bytes of every draft built so far, by label; a cut draft counts only its own MLPs (it shares
        the head and attention weights of the draft it was cut from)."""
        with self._lock:
            built = dict(self._built)
        out = {}
        for (kind, head, channels), d in built.items():
            out[d.label] = d.extra_bytes(mlp_only=channels is not None)
        return out

    def kept_channels(self, channels: str, keep: float) -> list[torch.Tensor]:
        """Each layer's kept MLP channel ids (ascending): the top `keep` share of ranking `channels`."""
        if channels not in self.channel_ranks:
            known = ", ".join(sorted(self.channel_ranks)) or "none installed"
            raise ValueError(f"no MLP channel ranking {channels!r} (known: {known}); load the calibration "
                             "that made the set")
        rank = self.channel_ranks[channels]
        k = max(1, int(round(keep * rank.shape[1])))
        return [row[:k].sort().values for row in rank]

    def get(self, kind: str = "int8", small_head: bool = True, skip: SkipSet | None = None):
        """The draft weights of a kind for a set; None when the draft reads the fp32 weights as they
        are. Only a channel set (SkipSet.channels) needs weights of its own."""
        head = small_head and self.head_ids is not None
        channels = skip.channel_key if skip is not None else None
        if kind == "fp32" and not head and channels is None:
            return None
        base, key = (kind, head, None), (kind, head, channels)
        with self._lock:                 # built once, shared by all sessions
            if base not in self._built:
                self._built[base] = DraftWeights(self._bb, kind, self.head_ids if head else None, self.int8_kernel)
            if key not in self._built:  # a cut draft shares the base's head and attention weights
                self._built[key] = cut_draft(self._built[base], self._bb, self.kept_channels(*channels), channels,
                                             self.channel_means.get(channels[0]))
                release_freed_memory()  # its fp32 cuts were temporaries
            return self._built[key]

    def for_set(self, draft: DraftWeights | None, skip: SkipSet | None):
        """What a set drafts with, given the draft weights for whole sublayers: `draft` itself, or for
        a channel set, weights of the same kind and head cut to its channels."""
        if skip is None or skip.channel_key is None:
            return draft
        return self.get("fp32" if draft is None else draft.kind, draft is not None and draft.head.ids is not None,
                        skip)
