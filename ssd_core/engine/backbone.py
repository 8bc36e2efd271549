"""Backbone: a Llama-family decoder run by our own compact forward.

The weights come from a transformers model; the forward is ours so that
(a) any attention / MLP sublayer can be skipped, (b) the KV cache is
preallocated and cut back to an absolute length in O(1), and (c) each layer
costs few Python operations (fused QKV and gate/up matmuls).
"""
from __future__ import annotations

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


@dataclass(frozen=True)
class Prefill:
    """What the prefill pass returns: next-token logits and the prompt embedding."""

    logits: torch.Tensor          # (vocab,) for the position after the prompt
    embedding: torch.Tensor       # mean of final-norm hidden states over the user's tokens
    embedding_all: torch.Tensor   # the same, pooled over the whole templated prompt


def _rope(x, cos, sin):
    """Rotary position embedding, rotate-half form (transformers' Llama layout)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


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


class _Layer:
    """One decoder layer's weights, fused for fewer matmuls."""

    __slots__ = ("ln1", "wqkv", "bqkv", "wo", "ln2", "wgu", "wdown")

    def __init__(self, hf_layer):
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.ln1 = hf_layer.input_layernorm.weight.detach()
        self.ln2 = hf_layer.post_attention_layernorm.weight.detach()
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        self.wqkv = torch.cat([p.weight.detach() for p in projs]).contiguous()
        biases = [p.bias for p in projs]
        if any(b is not None for b in biases):
            self.bqkv = torch.cat([b.detach() if b is not None else
                                   torch.zeros(p.out_features, dtype=p.weight.dtype, device=p.weight.device)
                                   for b, p in zip(biases, projs)])
        else:
            self.bqkv = None
        if attn.o_proj.bias is not None or mlp.down_proj.bias is not None or mlp.gate_proj.bias is not None:
            raise UnsupportedModelError("o_proj / MLP biases are not supported")
        self.wo = attn.o_proj.weight.detach()
        self.wgu = torch.cat([mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()]).contiguous()
        self.wdown = mlp.down_proj.weight.detach()


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
        cfg = hf_model.config
        self.name = name
        self.tokenizer = tokenizer
        self.config = cfg
        inner = hf_model.model
        self.n_layers = len(inner.layers)
        self.hidden = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or self.hidden // self.n_heads
        self.group = self.n_heads // self.n_kv
        self.eps = float(cfg.rms_norm_eps)
        self.dtype = inner.embed_tokens.weight.dtype
        self.device = inner.embed_tokens.weight.device     # every tensor the core makes goes here
        self.embed = inner.embed_tokens.weight.detach()
        self.lm_head = hf_model.lm_head.weight.detach()
        self.norm = inner.norm.weight.detach()
        self.vocab = self.lm_head.shape[0]
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.max_positions = min(int(getattr(cfg, "max_position_embeddings", max_positions) or max_positions),
                                 max_positions)
        with torch.no_grad():
            pos = torch.arange(self.max_positions, device=self.device).unsqueeze(0)
            probe = torch.zeros(1, 1, self.head_dim, dtype=self.dtype, device=self.device)
            cos, sin = inner.rotary_emb(probe, pos)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        self.attn_params = self.layers[0].wqkv.numel() + self.layers[0].wo.numel()
        self.mlp_params = self.layers[0].wgu.numel() + self.layers[0].wdown.numel()
        tied = self.lm_head.data_ptr() == self.embed.data_ptr()
        self.other_params = self.embed.numel() + (0 if tied else self.lm_head.numel())
        eos = [getattr(tokenizer, "eos_token_id", None), getattr(cfg, "eos_token_id", None)]
        self.eos_ids = frozenset(i for e in eos for i in (e if isinstance(e, (list, tuple)) else [e])
                                 if i is not None)
        self.hf_model = hf_model
        self.draft_head_ids: tuple[int, ...] | None = None   # the calibration's small draft head
        self._drafts: dict = {}
        self._drafts_lock = threading.Lock()

    def set_draft_head(self, ids) -> None:
        """Install the small draft head's token ids (from a calibration); None → the full vocabulary."""
        ids = None if ids is None else tuple(sorted({int(i) for i in ids}))
        with self._drafts_lock:
            if ids != self.draft_head_ids:
                self.draft_head_ids = ids
                self._drafts = {k: v for k, v in self._drafts.items() if not k[1]}

    def draft_weights(self, kind: str = "int8", small_head: bool = True):
        """The (cached) draft weights of a kind; None when the draft reads the fp32 weights as they are."""
        from .draft import DraftWeights

        head = small_head and self.draft_head_ids is not None
        if kind == "fp32" and not head:
            return None
        key = (kind, head)
        with self._drafts_lock:                 # built once (≈ 2 s for int8), shared by all sessions
            if key not in self._drafts:
                self._drafts[key] = DraftWeights(self, kind, self.draft_head_ids if head else None)
            return self._drafts[key]

    # --- sizes -------------------------------------------------------------------------------
    def weight_bytes(self, skip: SkipSet = EMPTY) -> int:
        """Bytes of weights one decode step reads (lm_head included, embedding row ignored)."""
        el = self.embed.element_size()
        per_layer = (self.n_layers - len(skip.attn)) * self.attn_params + \
                    (self.n_layers - len(skip.mlp)) * self.mlp_params
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
                collect: list | None = None, draft=None):
        """Run tokens `ids` at positions cache.length.. ; append their KV (non-skipped layers).

        logits: "last" → (vocab,), "all" → (T, vocab), "none" → final-norm hidden states (T, D).
        collect: if a list is given, (layer, kind, h_before, h_after) for every sublayer run.
        draft: a `draft.DraftWeights` to read instead of the fp32 weights (draft passes only).
        """
        layers, lin = (self.layers, F.linear) if draft is None else (draft.layers, draft.linear)
        if not torch.is_tensor(ids):
            ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        p0, end = cache.length, cache.length + ids.shape[0]
        if end > cache.max_len:
            raise ValueError(f"KV cache full: {end} > {cache.max_len} positions")
        rope, mask = (self.cos[p0:end], self.sin[p0:end]), self._causal_mask(p0, end)
        attn_skip, mlp_skip = skip.attn, skip.mlp
        x = self.embed[ids]
        for i, L in enumerate(layers):          # a skipped sublayer adds nothing: h stays h
            if i not in attn_skip:
                delta = self._attention(x, L, lin, cache, i, p0, rope, mask)
                if collect is not None:
                    collect.append((i, "attn", x, x + delta))
                x = x + delta
            if i not in mlp_skip:
                delta = self._mlp(x, L, lin)
                if collect is not None:
                    collect.append((i, "mlp", x, x + delta))
                x = x + delta
        cache.length = end
        if logits == "last":
            x = x[-1:]
        x = F.rms_norm(x, (self.hidden,), self.norm, self.eps)
        if logits == "none":
            return x
        out = F.linear(x, self.lm_head) if draft is None else draft.head(x)
        return out[0] if logits == "last" else out

    def _attention(self, x, L: _Layer, lin, cache: KVCache, i: int, p0: int, rope, mask):
        """One attention sublayer's Δ; writes layer i's keys / values for positions p0.. to the cache."""
        T, end = x.shape[0], p0 + x.shape[0]
        H, Hk, hd, g = self.n_heads, self.n_kv, self.head_dim, self.group
        qkv = lin(F.rms_norm(x, (self.hidden,), L.ln1, self.eps), L.wqkv, L.bqkv)
        q = _rope(qkv[:, :self.q_size].view(T, H, hd).transpose(0, 1), *rope)
        k = _rope(qkv[:, self.q_size:self.q_size + self.kv_size].view(T, Hk, hd).transpose(0, 1), *rope)
        cache.k[i, :, p0:end] = k
        cache.v[i, :, p0:end] = qkv[:, self.q_size + self.kv_size:].view(T, Hk, hd).transpose(0, 1)
        # GQA without copying K/V: the g query heads sharing a KV head become g·T rows
        o = F.scaled_dot_product_attention(
            q.reshape(Hk, g * T, hd), cache.k[i, :, :end], cache.v[i, :, :end], attn_mask=mask)
        return lin(o.view(H, T, hd).transpose(0, 1).reshape(T, H * hd), L.wo)

    def _mlp(self, x, L: _Layer, lin):
        """One SiLU-gated MLP sublayer's Δ (gate and up in one matmul)."""
        gate, up = lin(F.rms_norm(x, (self.hidden,), L.ln2, self.eps), L.wgu).chunk(2, -1)
        return lin(F.silu(gate) * up, L.wdown)

    def _causal_mask(self, p0: int, end: int):
        """Queries at p0..end-1 over keys 0..end-1, repeated for the GQA group (None for one token)."""
        if end - p0 <= 1:
            return None
        return (torch.arange(end, device=self.device).unsqueeze(0)
                <= torch.arange(p0, end, device=self.device).unsqueeze(1)).repeat(self.group, 1)

    @torch.inference_mode()
    def prefill(self, prompt: PromptIds, cache: KVCache) -> Prefill:
        """Run the prompt with the full model; return next-token logits and the embedding."""
        if cache.length != 0:
            raise ValueError("prefill expects an empty cache")
        hidden = self.forward(prompt.ids, cache, EMPTY, logits="none")
        logits = F.linear(hidden[-1], self.lm_head)
        a, b = prompt.user_span
        if b <= a:
            a, b = 0, hidden.shape[0]
        return Prefill(logits=logits, embedding=hidden[a:b].mean(0), embedding_all=hidden.mean(0))

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
