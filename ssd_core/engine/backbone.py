"""Backbone: a Llama-family decoder run by our own compact forward.

The weights come from a transformers model (weights.py); the forward is ours so that
(a) any attention / MLP sublayer can be skipped, (b) the KV cache is
preallocated and cut back to an absolute length in O(1) (kv_cache.py), and (c) each layer
costs few Python operations (fused QKV and gate/up matmuls). What a draft pass reads instead of
the fp32 weights comes from the draft-weights factory (`Backbone.drafts`, drafts.py).
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .device import device_label
from .drafts import DraftFactory
from .kv_cache import KVCache
from .machine import KERNELS, fastest_kernels
from .prompt import PromptIds, encode_prompt
from .skipset import SkipSet
from .weights import (LayerWeights, ModelWeights, onednn_available, onednn_linear, onednn_pack, split_linear,
                      split_pack, weights_from_hf, weights_from_state)

EMPTY = SkipSet.empty()


# The prompt embedding the router reads, named as calibrations record it: "last_token", the prefill's
# final-norm hidden state at the prompt's last position (after the chat template's assistant header it
# has read the whole prompt; the one whose logits give the first token; no extra pass). The user-token
# mean ("user_mean") that calibrations before routing/#31 used is no longer computed (issue #39).
EMBEDDING = "last_token"


@dataclass(frozen=True)
class Prefill:
    """What the prefill pass returns: next-token logits and the prompt embedding."""

    logits: torch.Tensor          # (vocab,) for the position after the prompt
    embedding: torch.Tensor       # EMBEDDING: the final-norm hidden state at the prompt's last position
    hidden: torch.Tensor | None = None   # (T, D) every position's, only when asked (calibration compares poolings)


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


class Backbone:
    """A decoder-only model with sublayer skipping and a preallocated KV cache."""

    def __init__(self, hf_model, tokenizer, name: str, max_positions: int = 8192):
        self._setup(weights_from_hf(hf_model, max_positions), tokenizer, name)
        self._hf_model, self._hf_loader = hf_model, None

    @classmethod
    def from_llama_state(cls, state: dict, config: dict, tokenizer, name: str, hf_loader,
                         max_positions: int = 8192) -> "Backbone":
        """A Backbone straight from a plain Llama's state dict (transformers' names) and config.json.

        It skips transformers' model class, whose import alone is ~3 s of a ~12 s warm start-up. The
        forward is ours either way; `hf_model` (the reference for lossless checks) is then built by
        `hf_loader()` on first use. A test holds both ways to the same tensors.
        """
        weights = weights_from_state(state, config, max_positions)
        self = cls.__new__(cls)
        self._setup(weights, tokenizer, name)
        self._hf_model, self._hf_loader = None, hf_loader
        return self

    def _setup(self, w: ModelWeights, tokenizer, name: str) -> None:
        cfg, embed, layers, cos, sin = w.config, w.embed, w.layers, w.cos, w.sin
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
        self.lm_head = w.lm_head
        self.norm = w.norm
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
        self.drafts = DraftFactory(self)  # what draft passes read: draft kinds, small head, channel sets
        self._lock = threading.Lock()   # guards the lazily built reference model
        self.kernel = ""                # the verifier's matmuls: "plain", "onednn" or "ONE/MANY" (set_kernel)
        self._copies = {}               # kernel → repacked copy of the weights ("onednn", "split"), while used
        self.set_kernel(os.environ.get("SSD_KERNEL", "auto"))

    def set_kernel(self, kernel: str = "auto") -> None:
        """The matmuls of the verifier's own forward (and of drafts that read the fp32 weights).

        "plain": F.linear on the weights as loaded. "onednn": the same fp32 weights prepacked once into
        oneDNN's blocked layout (a second copy, +4 bytes per parameter), which handles a few rows better
        than PyTorch's default fp32 GEMM (~1.9× for a 5-token verify on one Xeon) but may lose on one
        row. "split": the weights transposed and cut into one slab per thread, multiplied as one batched
        matmul (also a copy; on an AMD EPYC a one-row step 48.5 → 36.8 ms against oneDNN, because there
        a one-row GEMM runs on one thread). Same weights, same fp32 arithmetic up to summation order
        (≈1e-4 on the logits, as between a 1-row and a 5-row pass already). "ONE/MANY", e.g.
        "plain/onednn": one kernel for one-row passes (plain decoding, fp32 draft steps), another for
        several rows (verification, prefill). "auto": on a CPU in fp32, the fastest of each on this
        machine, measured once and cached (machine.fastest_kernels); elsewhere plain.
        """
        usable = onednn_available(self.device, self.dtype)
        if kernel == "auto":
            one, many = fastest_kernels(self) if usable else ("plain", "plain")
        else:
            one, _, many = kernel.partition("/")
            many = many or one
            if one not in KERNELS or many not in KERNELS:
                raise ValueError(f"kernel must be auto, {', '.join(KERNELS[:-1])} or {KERNELS[-1]} (or ONE/MANY, "
                                 f"e.g. plain/onednn), got {kernel!r}")
        if "onednn" in (one, many) and not usable:
            raise ValueError(f"oneDNN prepacked matmuls need fp32 weights on a CPU with mkldnn (here: "
                             f"{self.dtype} on {self.device})")
        self.use_kernels(one, many)

    def use_kernels(self, one: str, many: str, keep_packed: bool = False) -> None:
        """Run one-row passes on kernel `one` and several-row passes on `many` (KERNELS; no checks).
        keep_packed: keep the repacked copies even when neither kernel reads them (while switching back
        and forth to measure them: repacking all the weights takes ~0.3 s on two cores)."""
        def target(kernel):
            return (self.layers, F.linear, self.lm_head) if kernel == "plain" else self._copies[kernel]
        for kernel in (one, many):
            if kernel != "plain" and kernel not in self._copies:
                self._copies[kernel] = self._repacked(kernel)
        self._targets = (target(one), target(many))
        if not keep_packed:                 # a copy costs 4 bytes a parameter: keep only those in use
            self._copies = {k: v for k, v in self._copies.items() if k in (one, many)}
        self.kernel = one if one == many else f"{one}/{many}"

    def _repacked(self, kernel: str):
        """(layers, linear, lm_head) of the weights repacked for `kernel` ("onednn" or "split")."""
        threads = torch.get_num_threads()
        pack, lin = {"onednn": (onednn_pack, onednn_linear),
                     "split": (lambda w: split_pack(w, threads), split_linear)}[kernel]
        return [L.packed(pack) for L in self.layers], lin, pack(self.lm_head)

    def weights_changed(self) -> None:
        """Call after editing the weights in place: the repacked copies and the drafts are made again."""
        self._copies = {}
        self.drafts.clear()
        self.set_kernel(self.kernel)

    def head_logits(self, x):
        """The verifier's lm_head on final-norm hidden states (T, D) → (T, vocab)."""
        _, lin, head = self._targets[x.shape[0] > 1]
        return lin(x, head)

    @property
    def hf_model(self):
        """transformers' model of the same weights: the reference the lossless checks compare with."""
        with self._lock:
            if self._hf_model is None:
                self._hf_model = self._hf_loader()
            return self._hf_model

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
                collect: list | None = None, draft=None):
        """Run tokens `ids` at positions cache.length.. ; append their KV (non-skipped layers).

        logits: "last" → (vocab,), "all" → (T, vocab), "none" → final-norm hidden states (T, D).
        collect: if a list is given, (layer, kind, h_before, h_after) for every sublayer run.
        draft: a `draft.DraftWeights` to read instead of the fp32 weights (draft passes only).
        """
        if not torch.is_tensor(ids):
            ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        layers, lin = self._targets[ids.shape[0] > 1][:2] if draft is None else (draft.layers, draft.linear)
        p0, end = cache.length, cache.length + ids.shape[0]
        if end > cache.max_len:
            raise ValueError(f"KV cache full: {end} > {cache.max_len} positions")
        mask = self._causal_mask(p0, end)
        rope = (self.cos[p0:end], self.sin_rot[p0:end])
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
        out = self.head_logits(x) if draft is None else draft.head(x)
        return out[0] if logits == "last" else out

    def _attention(self, x, L: LayerWeights, lin, cache: KVCache, i: int, p0: int, rope, mask):
        """One attention sublayer's Δ; writes layer i's keys / values for positions p0.. to the cache."""
        T, end = x.shape[0], p0 + x.shape[0]
        H, Hk, hd, g = self.n_heads, self.n_kv, self.head_dim, self.group
        qkv = lin(F.rms_norm(x, (self.hidden,), L.ln1, self.eps), L.wqkv, L.bqkv)
        qk = _rope(qkv[:, :self.q_size + self.kv_size].view(T, H + Hk, hd).transpose(0, 1), *rope)
        q, k = qk[:H], qk[H:]                   # queries and keys rotated in one pass
        v = qkv[:, self.q_size + self.kv_size:].view(T, Hk, hd).transpose(0, 1)
        cache.k[i, :, p0:end], cache.v[i, :, p0:end] = k, v
        keys, values = cache.k[i, :, :end], cache.v[i, :, :end]
        # GQA without copying K/V: the g query heads sharing a KV head become g·T rows. With a batch
        # dimension PyTorch takes its fused CPU kernel (the 3-d call falls back to the unfused math
        # path): half the time for one token on this CPU
        o = F.scaled_dot_product_attention(q.reshape(1, Hk, g * T, hd), keys[None], values[None], attn_mask=mask)
        return lin(o.view(H, T, hd).transpose(0, 1).reshape(T, H * hd), L.wo)

    def _mlp(self, x, L: LayerWeights, lin):
        """One SiLU-gated MLP sublayer's Δ (gate and up in one matmul)."""
        gate, up = lin(F.rms_norm(x, (self.hidden,), L.ln2, self.eps), L.wgu).chunk(2, -1)
        return lin(F.silu(gate) * up, L.wdown, L.bdown)

    def _causal_mask(self, p0: int, end: int):
        """Queries at p0..end-1 over keys 0..end-1, repeated for the GQA group (None for one token)."""
        if end - p0 <= 1:
            return None
        return (torch.arange(end, device=self.device).unsqueeze(0)
                <= torch.arange(p0, end, device=self.device).unsqueeze(1)).repeat(self.group, 1)

    @torch.inference_mode()
    def prefill(self, prompt: PromptIds, cache: KVCache, keep_hidden: bool = False) -> Prefill:
        """Run the prompt with the full model; return next-token logits and the embedding (EMBEDDING).
        keep_hidden: also every position's final-norm hidden state (Prefill.hidden)."""
        if cache.length != 0:
            raise ValueError("prefill expects an empty cache")
        hidden = self.forward(prompt.ids, cache, EMPTY, logits="none")
        logits = self.head_logits(hidden[-1:])[0]
        return Prefill(logits=logits, embedding=hidden[-1], hidden=hidden if keep_hidden else None)

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
