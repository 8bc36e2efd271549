"""Backbone: a Llama-family decoder run by our own compact forward.

The weights come from a transformers model; the forward is ours so that
(a) any attention / MLP sublayer can be skipped, (b) the KV cache is
preallocated and cut back to an absolute length in O(1), and (c) each layer
costs few Python operations (fused QKV and gate/up matmuls).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .device import device_label
from .prompt import PromptIds, encode_prompt
from .skipset import SkipSet

EMPTY = SkipSet.empty()


class UnsupportedModelError(ValueError):
    """The model does not expose embeddings → decoder layers → final norm → lm_head."""


# How the prompt embedding is pooled from the prefill's final-norm hidden states (no extra pass):
# "last_token": the state at the prompt's last position (after the chat template's assistant header
# it has read the whole prompt; the one whose logits give the first token); "user_mean": the mean
# over the user's own tokens (the embedding of calibrations made before routing/#31).
EMBEDDINGS = ("last_token", "user_mean")
DEFAULT_EMBEDDING = "last_token"
LEGACY_EMBEDDING = "user_mean"      # what a calibration that records no embedding kind was made with


@dataclass(frozen=True)
class Prefill:
    """What the prefill pass returns: next-token logits and the prompt embedding."""

    logits: torch.Tensor          # (vocab,) for the position after the prompt
    embedding: torch.Tensor       # pooled as the backbone's `embedding_kind` says (EMBEDDINGS)
    embedding_all: torch.Tensor   # mean over the whole templated prompt
    embedding_user: torch.Tensor | None = None   # mean over the user's tokens only


def _rope(x, cos, sin_rot):
    """Rotary position embedding, rotate-half form (transformers' Llama layout).

    rotate_half(x)·sin = cat(-x₂, x₁)·sin = roll(x, half)·sin_rot with sin_rot = cat(-sin₁, sin₂)
    (`_signed_sin`): three ops instead of seven, which matters for one-token steps on a CPU.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_rot)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated (what `_rope` multiplies the rolled x by)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), -1)


class KVCache:
    """Preallocated keys/values for every layer; `length` positions are valid."""

    def __init__(self, n_layers: int, n_kv: int, max_len: int, head_dim: int, dtype, device=None):
        self.k = torch.zeros(n_layers, n_kv, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n_layers, n_kv, max_len, head_dim, dtype=dtype, device=device)
        self.length = 0
        self.max_len = max_len

    def crop(self, length: int) -> None:
        """Cut back every layer to an absolute length (positions past it are dead)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length


def _onednn_linear(x, w, b=None):
    """x @ w.T (+ b) with `w` prepacked by `_onednn_pack` (oneDNN's fp32 GEMM, blocked weight layout)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())


def onednn_available(device: torch.device, dtype) -> bool:
    """Whether the verifier's fp32 matmuls can run on oneDNN-prepacked weights here."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class _Layer:
    """One decoder layer's weights, fused for fewer matmuls."""

    __slots__ = ("ln1", "wqkv", "bqkv", "wo", "ln2", "wgu", "wdown")
    bdown = None                        # the model's MLPs have no output bias (a draft's may: draft.py)

    def __init__(self, ln1, ln2, q, k, v, o, gate, up, down, qkv_bias=None):
        """Plain tensors; qkv_bias: the (q, k, v) biases, None where a projection has none."""
        self.ln1, self.ln2 = ln1.detach(), ln2.detach()
        self.wqkv = torch.cat([q.detach(), k.detach(), v.detach()]).contiguous()
        if qkv_bias is not None and any(b is not None for b in qkv_bias):
            self.bqkv = torch.cat([b.detach() if b is not None else
                                   torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
                                   for b, w in zip(qkv_bias, (q, k, v))])
        else:
            self.bqkv = None
        self.wo = o.detach()
        self.wgu = torch.cat([gate.detach(), up.detach()]).contiguous()
        self.wdown = down.detach()

    def packed(self) -> "_Layer":
        """The same layer with its matrices prepacked for `_onednn_linear` (norms and biases as they are)."""
        out = _Layer.__new__(_Layer)
        out.ln1, out.ln2, out.bqkv = self.ln1, self.ln2, self.bqkv
        out.wqkv, out.wo, out.wgu, out.wdown = (_onednn_pack(w) for w in (self.wqkv, self.wo, self.wgu, self.wdown))
        return out

    @classmethod
    def from_hf(cls, hf_layer) -> "_Layer":
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        if attn.o_proj.bias is not None or mlp.down_proj.bias is not None or mlp.gate_proj.bias is not None:
            raise UnsupportedModelError("o_proj / MLP biases are not supported")
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        return cls(hf_layer.input_layernorm.weight, hf_layer.post_attention_layernorm.weight,
                   *(p.weight for p in projs), attn.o_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                   mlp.down_proj.weight, qkv_bias=[p.bias for p in projs])

    @classmethod
    def from_state(cls, state: dict, i: int) -> "_Layer":
        """Layer i of a transformers-named Llama state dict (no biases)."""
        w = lambda name: state[f"model.layers.{i}.{name}.weight"]     # noqa: E731
        return cls(w("input_layernorm"), w("post_attention_layernorm"), w("self_attn.q_proj"),
                   w("self_attn.k_proj"), w("self_attn.v_proj"), w("self_attn.o_proj"), w("mlp.gate_proj"),
                   w("mlp.up_proj"), w("mlp.down_proj"))


def default_rope(theta: float, head_dim: int, positions: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables (positions, head_dim) of Llama's unscaled rotary embedding, computed as
    transformers' "default" rope does (float32 inverse frequencies times positions)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = inv[:, None] @ torch.arange(positions, device=device).float()[None, :]
    emb = torch.cat((freqs.T, freqs.T), -1)
    return emb.cos(), emb.sin()


def _rope_shape(config: dict, max_positions: int) -> tuple[int, int]:
    """(positions, head_dim) of the rope tables a config asks for, positions capped at max_positions."""
    positions = min(int(config.get("max_position_embeddings") or max_positions), max_positions)
    return positions, config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def plain_llama_rope_theta(config: dict) -> float | None:
    """rope θ when a config.json describes a plain Llama (no biases, SiLU, unscaled rope), else None."""
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling")
    if (config.get("model_type") != "llama" or config.get("hidden_act", "silu") not in ("silu", "swish")
            or config.get("attention_bias") or config.get("mlp_bias") or scaling
            or rope.get("rope_type", "default") != "default"):
        return None
    theta = rope.get("rope_theta", config.get("rope_theta"))
    return float(theta) if theta else None


_REQUIRED = {
    "model.embed_tokens": lambda m: m.model.embed_tokens,
    "model.layers": lambda m: m.model.layers,
    "model.norm": lambda m: m.model.norm,
    "lm_head": lambda m: m.lm_head,
    "model.rotary_emb": lambda m: m.model.rotary_emb,
    "layers[0].self_attn.{q,k,v,o}_proj": lambda m: [getattr(m.model.layers[0].self_attn, n)
                                                     for n in ("q_proj", "k_proj", "v_proj", "o_proj")],
    "layers[0].mlp.{gate,up,down}_proj": lambda m: [getattr(m.model.layers[0].mlp, n)
                                                    for n in ("gate_proj", "up_proj", "down_proj")],
    "layers[0].{input,post_attention}_layernorm": lambda m: (m.model.layers[0].input_layernorm.weight,
                                                             m.model.layers[0].post_attention_layernorm.weight),
}


def check_architecture(hf_model) -> None:
    missing = []
    for what, get in _REQUIRED.items():
        try:
            get(hf_model)
        except (AttributeError, IndexError, TypeError):
            missing.append(what)
    act = getattr(hf_model.config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        missing.append(f"a SiLU-gated MLP (hidden_act is {act!r})")
    if missing:
        raise UnsupportedModelError(
            f"{type(hf_model).__name__} is not a supported Llama-family decoder: missing "
            + ", ".join(missing) + ". Supported: Llama, Qwen2, Mistral and look-alikes.")


class Backbone:
    """A decoder-only model with sublayer skipping and a preallocated KV cache."""

    def __init__(self, hf_model, tokenizer, name: str, max_positions: int = 8192):
        check_architecture(hf_model)
        inner = hf_model.model
        cfg = hf_model.config.to_dict()
        embed = inner.embed_tokens.weight.detach()
        n_pos, head_dim = _rope_shape(cfg, max_positions)
        with torch.no_grad():
            pos = torch.arange(n_pos, device=embed.device).unsqueeze(0)
            cos, sin = inner.rotary_emb(torch.zeros(1, 1, head_dim, dtype=embed.dtype, device=embed.device), pos)
        self._setup(cfg, tokenizer, name, embed, hf_model.lm_head.weight.detach(), inner.norm.weight.detach(),
                    [_Layer.from_hf(layer) for layer in inner.layers], cos[0], sin[0])
        self._hf_model, self._hf_loader = hf_model, None

    @classmethod
    def from_llama_state(cls, state: dict, config: dict, tokenizer, name: str, hf_loader,
                         max_positions: int = 8192) -> "Backbone":
        """A Backbone straight from a plain Llama's state dict (transformers' names) and config.json.

        It skips transformers' model class, whose import alone is ~3 s of a ~12 s warm start-up. The
        forward is ours either way; `hf_model` (the reference for lossless checks) is then built by
        `hf_loader()` on first use. A test holds both ways to the same tensors.
        """
        theta = plain_llama_rope_theta(config)
        if theta is None:
            raise UnsupportedModelError("not a plain Llama config (biases, scaled rope or another model type)")
        missing = [k for k in ("model.embed_tokens.weight", "model.norm.weight") if k not in state]
        if missing:
            raise UnsupportedModelError("missing " + ", ".join(missing))
        embed = state["model.embed_tokens.weight"]
        positions, head_dim = _rope_shape(config, max_positions)
        cos, sin = default_rope(theta, head_dim, positions, embed.device)
        self = cls.__new__(cls)
        self._setup(config, tokenizer, name, embed, state.get("lm_head.weight", embed), state["model.norm.weight"],
                    [_Layer.from_state(state, i) for i in range(config["num_hidden_layers"])], cos, sin)
        self._hf_model, self._hf_loader = None, hf_loader
        return self

    def _setup(self, cfg: dict, tokenizer, name: str, embed, lm_head, norm, layers: list, cos, sin) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.n_layers = len(layers)
        self.hidden = cfg["hidden_size"]
        self.n_heads = cfg["num_attention_heads"]
        self.n_kv = cfg.get("num_key_value_heads") or self.n_heads
        self.head_dim = cos.shape[-1]
        self.group = self.n_heads // self.n_kv
        self.eps = float(cfg["rms_norm_eps"])
        self.dtype = embed.dtype
        self.device = embed.device     # every tensor the core makes goes here
        self.embed = embed
        self.lm_head = lm_head
        self.norm = norm
        self.vocab = self.lm_head.shape[0]
        self.layers = layers
        self.max_positions = cos.shape[0]
        self.cos, self.sin_rot = cos.to(self.dtype), _signed_sin(sin.to(self.dtype))   # what _rope reads
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.attn_params = self.layers[0].wqkv.numel() + self.layers[0].wo.numel()
        self.mlp_params = self.layers[0].wgu.numel() + self.layers[0].wdown.numel()
        tied = self.lm_head.data_ptr() == self.embed.data_ptr()
        self.other_params = self.embed.numel() + (0 if tied else self.lm_head.numel())
        eos = [getattr(tokenizer, "eos_token_id", None), cfg.get("eos_token_id")]
        self.eos_ids = frozenset(i for e in eos for i in (e if isinstance(e, (list, tuple)) else [e])
                                 if i is not None)
        self.draft_head_ids: tuple[int, ...] | None = None   # the calibration's small draft head
        self.embedding_kind = DEFAULT_EMBEDDING     # Prefill.embedding's pooling (the calibration's, set_embedding)
        # the calibration's MLP channel rankings (name → (layers, channels) ids, most important first)
        self.channel_ranks: dict[str, torch.Tensor] = {}
        # mean activations of rankings whose cut drafts replace dropped channels by their mean
        self.channel_means: dict[str, torch.Tensor] = {}
        self._drafts: dict = {}
        self._lock = threading.Lock()   # guards the lazily built drafts and reference model
        self.kernel = ""                # the verifier's matmuls: "plain" or "onednn" (set_kernel)
        self.set_kernel(os.environ.get("SSD_KERNEL", "auto"))

    def set_kernel(self, kernel: str = "auto") -> None:
        """The matmuls of the verifier's own forward (and of drafts that read the fp32 weights).

        "plain": F.linear on the weights as loaded. "onednn": the same fp32 weights prepacked once into
        oneDNN's blocked layout (a second copy, +4 bytes per parameter); on CPUs it is ~1.4× faster for
        one token and ~1.9× for a 5-token verify, because PyTorch's default fp32 GEMM handles a few rows
        badly. Same weights, same fp32 arithmetic up to summation order (≈1e-4 on the logits, as
        between a 1-row and a 5-row pass already). "auto": onednn on a CPU in fp32, else plain.
        """
        if kernel not in ("auto", "plain", "onednn"):
            raise ValueError(f"kernel must be auto, plain or onednn, got {kernel!r}")
        usable = onednn_available(self.device, self.dtype)
        if kernel == "onednn" and not usable:
            raise ValueError(f"oneDNN prepacked matmuls need fp32 weights on a CPU with mkldnn (here: "
                             f"{self.dtype} on {self.device})")
        if kernel == "plain" or not usable:
            self.kernel, self._target = "plain", (self.layers, F.linear, self.lm_head)
        elif self.kernel != "onednn":
            self._target = ([L.packed() for L in self.layers], _onednn_linear, _onednn_pack(self.lm_head))
            self.kernel = "onednn"

    def weights_changed(self) -> None:
        """Call after editing the weights in place: the packed copy and the drafts are made again."""
        kernel, self.kernel = self.kernel, ""
        with self._lock:
            self._drafts = {}
        self.set_kernel(kernel)

    def head_logits(self, x):
        """The verifier's lm_head on final-norm hidden states (T, D) → (T, vocab)."""
        return self._target[1](x, self._target[2])

    @property
    def hf_model(self):
        """transformers' model of the same weights: the reference the lossless checks compare with."""
        with self._lock:
            if self._hf_model is None:
                self._hf_model = self._hf_loader()
            return self._hf_model

    def set_draft_head(self, ids) -> None:
        """Install the small draft head's token ids (from a calibration); None → the full vocabulary."""
        ids = None if ids is None else tuple(sorted({int(i) for i in ids}))
        with self._lock:
            if ids != self.draft_head_ids:
                self.draft_head_ids = ids
                self._drafts = {k: v for k, v in self._drafts.items() if not k[1]}

    def set_embedding(self, kind: str) -> None:
        """Pool Prefill.embedding as `kind` (EMBEDDINGS): the kind the loaded router was built with."""
        if kind not in EMBEDDINGS:
            raise ValueError(f"unknown embedding kind {kind!r}; known: {', '.join(EMBEDDINGS)}")
        self.embedding_kind = kind

    def set_channel_ranks(self, ranks: dict | None, means: dict | None = None) -> None:
        """Install a calibration's MLP channel rankings ({name: (layers, channels) ids}); None → none.
        means: {name: (layers, channels) mean activations} for rankings whose cut drafts add their
        dropped channels' mean (calibration/channels.py: channel_means); None → no ranking's do."""
        ranks = {str(k): torch.as_tensor(v, dtype=torch.long, device=self.device) for k, v in (ranks or {}).items()}
        means = {str(k): torch.as_tensor(v, dtype=self.dtype, device=self.device) for k, v in (means or {}).items()}
        inter = self.layers[0].wdown.shape[1]
        for what, table in (("ranking", ranks), ("mean activations", means)):
            for name, r in table.items():
                if r.shape != (self.n_layers, inter):
                    raise ValueError(f"channel {what} {name!r} has shape {tuple(r.shape)}; this model needs "
                                     f"({self.n_layers}, {inter})")
        if set(means) - set(ranks):
            raise ValueError(f"mean activations for rankings that are not installed: {sorted(set(means) - set(ranks))}")
        with self._lock:
            self.channel_ranks, self.channel_means = ranks, means
            self._drafts = {k: v for k, v in self._drafts.items() if k[2] is None}

    def kept_channels(self, channels: str, keep: float) -> list[torch.Tensor]:
        """Each layer's kept MLP channel ids (ascending): the top `keep` share of ranking `channels`."""
        if channels not in self.channel_ranks:
            known = ", ".join(sorted(self.channel_ranks)) or "none installed"
            raise ValueError(f"no MLP channel ranking {channels!r} (known: {known}); load the calibration "
                             "that made the set")
        rank = self.channel_ranks[channels]
        k = max(1, int(round(keep * rank.shape[1])))
        return [row[:k].sort().values for row in rank]

    def draft_for(self, draft, skip: SkipSet | None):
        """What a set drafts with, given the draft weights for whole sublayers: `draft` itself, or for
        a set that keeps part of each MLP (SkipSet.channels), weights of the same kind and head cut
        to its channels."""
        if skip is None or skip.channel_key is None:
            return draft
        small = draft is not None and draft.head.ids is not None
        return self.draft_weights("fp32" if draft is None else draft.kind, small, skip)

    def draft_weights(self, kind: str = "int8", small_head: bool = True, skip: SkipSet | None = None):
        """The (cached) draft weights of a kind for a set; None when the draft reads the fp32 weights as
        they are. Only a set that keeps part of each MLP (SkipSet.channels) needs weights of its own."""
        from .draft import DraftWeights

        head = small_head and self.draft_head_ids is not None
        channels = skip.channel_key if skip is not None else None
        if kind == "fp32" and not head and channels is None:
            return None
        base, key = (kind, head, None), (kind, head, channels)
        with self._lock:                 # built once (≈ 0.6 s for int8 on 2 cores), shared by all sessions
            if base not in self._drafts:
                self._drafts[base] = DraftWeights(self, kind, self.draft_head_ids if head else None)
            if key not in self._drafts:  # a cut draft shares the base's head and attention weights
                self._drafts[key] = self._drafts[base].cut(self, self.kept_channels(*channels), channels,
                                                           self.channel_means.get(channels[0]))
            return self._drafts[key]

    # --- sizes -------------------------------------------------------------------------------
    def weight_bytes(self, skip: SkipSet = EMPTY) -> int:
        """Bytes of weights one decode step reads (lm_head included, embedding row ignored)."""
        el = self.embed.element_size()
        per_layer = (self.n_layers - len(skip.attn)) * self.attn_params + \
                    (self.n_layers - len(skip.mlp)) * self.mlp_params * skip.keep
        return el * (per_layer + self.lm_head.numel())

    def skip_weight_ratio(self, skip: SkipSet) -> float:
        return skip.weight_ratio(self.attn_params, self.mlp_params, self.n_layers, self.lm_head.numel())

    def new_cache(self, max_len: int) -> KVCache:
        if max_len > self.max_positions:
            raise ValueError(f"context of {max_len} tokens exceeds the model's {self.max_positions}")
        return KVCache(self.n_layers, self.n_kv, max_len, self.head_dim, self.dtype, self.device)

    def sync(self) -> None:
        """Wait for queued device work before reading a clock (CUDA runs kernels asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- the forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids, cache: KVCache, skip: SkipSet = EMPTY, logits: str = "last",
                collect: list | None = None, draft=None, window: int | None = None):
        """Run tokens `ids` at positions cache.length.. ; append their KV (non-skipped layers).

        logits: "last" → (vocab,), "all" → (T, vocab), "none" → final-norm hidden states (T, D).
        collect: if a list is given, (layer, kind, h_before, h_after) for every sublayer run.
        draft: a `draft.DraftWeights` to read instead of the fp32 weights (draft passes only).
        window: a teacher-forced draft pass as decoding sees it (calibration only). The cache must
        already hold the full model's keys / values for every position up to the last of `ids`.
        The tokens fall into blocks of `window` from cache.length; a query reads the cache before its
        block starts (the verified context) and its own block's keys up to itself, which is what the
        k-th token of a draft of that length reads. Nothing is written to the cache.
        """
        layers, lin = self._target[:2] if draft is None else (draft.layers, draft.linear)
        if not torch.is_tensor(ids):
            ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        p0, end = cache.length, cache.length + ids.shape[0]
        if end > cache.max_len:
            raise ValueError(f"KV cache full: {end} > {cache.max_len} positions")
        mask = self._causal_mask(p0, end) if window is None else self._window_mask(p0, end, window)
        rope = (self.cos[p0:end], self.sin_rot[p0:end])
        attn_skip, mlp_skip = skip.attn, skip.mlp
        x = self.embed[ids]
        for i, L in enumerate(layers):          # a skipped sublayer adds nothing: h stays h
            if i not in attn_skip:
                delta = self._attention(x, L, lin, cache, i, p0, rope, mask, own=window is not None)
                if collect is not None:
                    collect.append((i, "attn", x, x + delta))
                x = x + delta
            if i not in mlp_skip:
                delta = self._mlp(x, L, lin)
                if collect is not None:
                    collect.append((i, "mlp", x, x + delta))
                x = x + delta
        if window is None:
            cache.length = end
        if logits == "last":
            x = x[-1:]
        x = F.rms_norm(x, (self.hidden,), self.norm, self.eps)
        if logits == "none":
            return x
        out = self.head_logits(x) if draft is None else draft.head(x)
        return out[0] if logits == "last" else out

    def _attention(self, x, L: _Layer, lin, cache: KVCache, i: int, p0: int, rope, mask, own: bool = False):
        """One attention sublayer's Δ; writes layer i's keys / values for positions p0.. to the cache
        (own: leaves the cache alone and appends them after its positions 0..end-1 instead)."""
        T, end = x.shape[0], p0 + x.shape[0]
        H, Hk, hd, g = self.n_heads, self.n_kv, self.head_dim, self.group
        qkv = lin(F.rms_norm(x, (self.hidden,), L.ln1, self.eps), L.wqkv, L.bqkv)
        qk = _rope(qkv[:, :self.q_size + self.kv_size].view(T, H + Hk, hd).transpose(0, 1), *rope)
        q, k = qk[:H], qk[H:]                   # queries and keys rotated in one pass
        v = qkv[:, self.q_size + self.kv_size:].view(T, Hk, hd).transpose(0, 1)
        if own:
            keys, values = torch.cat([cache.k[i, :, :end], k], 1), torch.cat([cache.v[i, :, :end], v], 1)
        else:
            cache.k[i, :, p0:end], cache.v[i, :, p0:end] = k, v
            keys, values = cache.k[i, :, :end], cache.v[i, :, :end]
        # GQA without copying K/V: the g query heads sharing a KV head become g·T rows. With a batch
        # dimension PyTorch takes its fused CPU kernel (the 3-d call falls back to the unfused math
        # path): half the time for one token on this CPU
        o = F.scaled_dot_product_attention(q.reshape(1, Hk, g * T, hd), keys[None], values[None], attn_mask=mask)
        return lin(o.view(H, T, hd).transpose(0, 1).reshape(T, H * hd), L.wo)

    def _mlp(self, x, L: _Layer, lin):
        """One SiLU-gated MLP sublayer's Δ (gate and up in one matmul)."""
        gate, up = lin(F.rms_norm(x, (self.hidden,), L.ln2, self.eps), L.wgu).chunk(2, -1)
        return lin(F.silu(gate) * up, L.wdown, L.bdown)

    def _causal_mask(self, p0: int, end: int):
        """Queries at p0..end-1 over keys 0..end-1, repeated for the GQA group (None for one token)."""
        if end - p0 <= 1:
            return None
        return (torch.arange(end, device=self.device).unsqueeze(0)
                <= torch.arange(p0, end, device=self.device).unsqueeze(1)).repeat(self.group, 1)

    def _window_mask(self, p0: int, end: int, window: int):
        """forward(window=…): queries at p0..end-1 over the cached keys 0..end-1, then their own."""
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        t = torch.arange(end - p0, device=self.device).unsqueeze(1)
        block = p0 + t - t % window                      # the position where t's draft block starts
        cached = torch.arange(end, device=self.device).unsqueeze(0) < block
        own = torch.arange(end - p0, device=self.device).unsqueeze(0)
        own = (own >= block - p0) & (own <= t)
        return torch.cat([cached, own], 1).repeat(self.group, 1)

    @torch.inference_mode()
    def prefill(self, prompt: PromptIds, cache: KVCache) -> Prefill:
        """Run the prompt with the full model; return next-token logits and the embedding."""
        if cache.length != 0:
            raise ValueError("prefill expects an empty cache")
        hidden = self.forward(prompt.ids, cache, EMPTY, logits="none")
        logits = self.head_logits(hidden[-1:])[0]
        a, b = prompt.user_span
        if b <= a:
            a, b = 0, hidden.shape[0]
        user = hidden[a:b].mean(0)
        embedding = hidden[-1] if self.embedding_kind == "last_token" else user
        return Prefill(logits=logits, embedding=embedding, embedding_all=hidden.mean(0), embedding_user=user)

    # --- text ----------------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool | None = None, max_tokens: int | None = None) -> PromptIds:
        """Tokenise a user prompt (chat template for instruct models) and find the user's span."""
        return encode_prompt(self.tokenizer, prompt, chat, max_tokens)

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_str(self, i: int) -> str:
        return self.tokenizer.decode([int(i)], skip_special_tokens=False)

    def describe(self) -> dict:
        return {"model": self.name, "n_layers": self.n_layers, "hidden": self.hidden,
                "n_heads": self.n_heads, "n_kv_heads": self.n_kv, "vocab": self.vocab,
                "dtype": str(self.dtype).replace("torch.", ""), "device": device_label(self.device),
                "params_m": round((self.n_layers * (self.attn_params + self.mlp_params)
                                   + self.other_params) / 1e6, 1)}
