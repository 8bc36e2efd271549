"""Model weights as the compact forward reads them: fused per layer, checked, optionally prepacked.

A transformers Llama-family model (or a plain Llama state dict) becomes `ModelWeights`: the
embedding, final norm, lm_head, rotary tables and one `LayerWeights` per decoder layer, whose q/k/v
and gate/up matrices are concatenated so a layer costs two matmuls fewer. The verifier's matmuls may
run on oneDNN-prepacked copies of the same fp32 weights (`onednn_pack`) or on transposed copies cut
into one slab per thread (`split_pack`); Backbone.set_kernel chooses.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class UnsupportedModelError(ValueError):
    """The model does not expose embeddings → decoder layers → final norm → lm_head."""


def onednn_linear(x, w, b=None):
    """x @ w.T (+ b) with `w` prepacked by `onednn_pack` (oneDNN's fp32 GEMM, blocked weight layout)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


def onednn_pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())


def split_pack(w: torch.Tensor, parts: int) -> torch.Tensor:
    """`w` (out, in) transposed and cut along its outputs into `parts` contiguous slabs: (parts, in, out/parts).
    One slab per thread: `split_linear` multiplies them as one batched matmul, which PyTorch spreads over
    its threads (a one-row `F.linear` reads the whole matrix on one of them on some CPUs). parts=1 where
    the outputs do not divide evenly."""
    parts = parts if parts > 1 and w.shape[0] % parts == 0 else 1
    return w.t().reshape(w.shape[1], parts, w.shape[0] // parts).transpose(0, 1).contiguous()


def split_linear(x, w, b=None):
    """x @ W.T (+ b) with W packed by `split_pack`: each slab's outputs, side by side."""
    parts, _, n = w.shape
    y = torch.bmm(x.expand(parts, *x.shape), w)
    y = y.view(1, parts * n) if x.shape[0] == 1 else y.transpose(0, 1).reshape(x.shape[0], parts * n)
    return y if b is None else y + b


def onednn_available(device: torch.device, dtype) -> bool:
    """Whether the verifier's fp32 matmuls can run on oneDNN-prepacked weights here."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class LayerWeights:
    """One decoder layer's weights, fused for fewer matmuls."""

    __slots__ = ("ln1", "wqkv", "bqkv", "wo", "ln2", "wgu", "wdown")
    bdown = None                        # the model's MLPs have no output bias (a cut draft's may: drafts.py)

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

    def packed(self, pack=onednn_pack) -> "LayerWeights":
        """The same layer with its matrices repacked by `pack` (default: prepacked for `onednn_linear`);
        norms and biases as they are."""
        out = LayerWeights.__new__(LayerWeights)
        out.ln1, out.ln2, out.bqkv = self.ln1, self.ln2, self.bqkv
        out.wqkv, out.wo, out.wgu, out.wdown = (pack(w) for w in (self.wqkv, self.wo, self.wgu, self.wdown))
        return out

    @classmethod
    def from_hf(cls, hf_layer) -> "LayerWeights":
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        if attn.o_proj.bias is not None or mlp.down_proj.bias is not None or mlp.gate_proj.bias is not None:
            raise UnsupportedModelError("o_proj / MLP biases are not supported")
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        return cls(hf_layer.input_layernorm.weight, hf_layer.post_attention_layernorm.weight,
                   *(p.weight for p in projs), attn.o_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                   mlp.down_proj.weight, qkv_bias=[p.bias for p in projs])

    @classmethod
    def from_state(cls, state: dict, i: int) -> "LayerWeights":
        """Layer i of a transformers-named Llama state dict (no biases)."""
        w = lambda name: state[f"model.layers.{i}.{name}.weight"]     # noqa: E731
        return cls(w("input_layernorm"), w("post_attention_layernorm"), w("self_attn.q_proj"),
                   w("self_attn.k_proj"), w("self_attn.v_proj"), w("self_attn.o_proj"), w("mlp.gate_proj"),
                   w("mlp.up_proj"), w("mlp.down_proj"))


@dataclass
class ModelWeights:
    """Everything the forward reads, plus the config.json dict it came with."""

    config: dict
    embed: torch.Tensor
    lm_head: torch.Tensor            # may be the embedding itself (tied)
    norm: torch.Tensor
    layers: list[LayerWeights]
    cos: torch.Tensor                # (positions, head_dim) rotary tables
    sin: torch.Tensor


def default_rope(theta: float, head_dim: int, positions: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin tables (positions, head_dim) of Llama's unscaled rotary embedding, computed as
    transformers' "default" rope does (float32 inverse frequencies times positions)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    freqs = inv[:, None] @ torch.arange(positions, device=device).float()[None, :]
    emb = torch.cat((freqs.T, freqs.T), -1)
    return emb.cos(), emb.sin()


def rope_shape(config: dict, max_positions: int) -> tuple[int, int]:
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


def weights_from_hf(hf_model, max_positions: int = 8192) -> ModelWeights:
    """The fused weights of a transformers model (checked to be a supported Llama-family decoder)."""
    check_architecture(hf_model)
    inner = hf_model.model
    cfg = hf_model.config.to_dict()
    embed = inner.embed_tokens.weight.detach()
    n_pos, head_dim = rope_shape(cfg, max_positions)
    with torch.no_grad():
        pos = torch.arange(n_pos, device=embed.device).unsqueeze(0)
        cos, sin = inner.rotary_emb(torch.zeros(1, 1, head_dim, dtype=embed.dtype, device=embed.device), pos)
    return ModelWeights(cfg, embed, hf_model.lm_head.weight.detach(), inner.norm.weight.detach(),
                        [LayerWeights.from_hf(layer) for layer in inner.layers], cos[0], sin[0])


def weights_from_state(state: dict, config: dict, max_positions: int = 8192) -> ModelWeights:
    """The fused weights of a plain Llama's state dict (transformers' names) and config.json."""
    theta = plain_llama_rope_theta(config)
    if theta is None:
        raise UnsupportedModelError("not a plain Llama config (biases, scaled rope or another model type)")
    missing = [k for k in ("model.embed_tokens.weight", "model.norm.weight") if k not in state]
    if missing:
        raise UnsupportedModelError("missing " + ", ".join(missing))
    embed = state["model.embed_tokens.weight"]
    positions, head_dim = rope_shape(config, max_positions)
    cos, sin = default_rope(theta, head_dim, positions, embed.device)
    return ModelWeights(config, embed, state.get("lm_head.weight", embed), state["model.norm.weight"],
                        [LayerWeights.from_state(state, i) for i in range(config["num_hidden_layers"])], cos, sin)
