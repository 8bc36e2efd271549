"""Cheap drafts of the same model: quantised draft weights and a small draft head.

The verifier always runs the unchanged fp32 weights, so none of this changes the output; it only
changes how often the draft agrees with the verifier and how little a draft step costs.

Draft kinds (`DraftWeights.kind`):
- "fp32": the model's own weights (layer skipping is the only saving);
- "int8": every decoder matmul and the lm_head as per-output-channel int8 weights, run by PyTorch's
  dynamic-quantisation CPU kernel (`quantized::linear_dynamic`: int8 weights, activations quantised
  per call). Measured on this 2-core AVX2 CPU, one token: 3× faster than fp32 on the 3072×576 gate/up
  matrix, 2× on down, 5-10× on the 49152×576 lm_head; the small q/k/v and o matrices gain little
  (on some Xeons fp32 won them alone, yet a whole draft pass with them in fp32 ran slower: every
  matrix is int8, docs/performance.md). The other weight-only kernels in PyTorch's CPU build were
  slower here (int8pack with fp32 activations 7-10×, int4pack with fp32 activations 10-30× slower;
  with bf16 activations they sit between).
  That kernel is CPU-only: on another device (CUDA) the int8 draft keeps the same per-channel int8
  rounding of the weights but holds them dequantised in the model's dtype and runs ordinary matmuls
  (weight-only: activations stay in full precision). It drafts like the int8 draft but costs what
  fp32 costs; its label says so ("int8-rounded draft, run in float32 on cuda"). On an x86 CPU
  without VNNI the kernel's int16 pair sums saturate with 8-bit weights, so the codes there use 7 bits
  (WEIGHT_LEVELS below).

Small draft head (FR-Spec): the draft's lm_head keeps only `head_ids`, the tokens the model itself
emits most often on the calibration prompts. Logits of every other token are -inf in the draft, so a
draft never proposes them (in sampling mode the draft distribution is renormalised over the subset,
and the acceptance rule stays exact because q is what the draft really sampled from).
"""
from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DRAFT_KINDS = ("int8", "fp32")
DEFAULT_DRAFT_KIND = "int8"       # the draft weights alone (the app adds prompt lookup on top)


def _cpu_has_vnni() -> bool:
    """Whether the CPU multiplies int8 pairs without int16 saturation (AVX512-VNNI or AVX-VNNI)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


# The largest weight code. fbgemm's int8 kernel on an x86 CPU without VNNI (AMD EPYC before Zen 4,
# Intel before Cascade Lake: many cloud and free Space machines) multiplies pairs of u8 activations
# and s8 weights into int16 with saturation (vpmaddubsw): 2·255·127 overflows. Measured on such a CPU
# (SmolLM2-135M, token-by-token drafts over 4 prompts × 32 tokens): 8-bit weights agreed with the
# fp32 model on 59% of the tokens; 7-bit weights (|code| ≤ 63, 2·255·64 fits) on 92%, the same
# weights with 8-bit activations quantised to 7 bits (reduce_range) on 87%. With VNNI there is no
# saturation and the finer 8-bit codes are kept (weight-only error: 97% vs 94% agreement).
WEIGHT_LEVELS = 127 if _cpu_has_vnni() else 63


def _int8_codes(w: torch.Tensor, levels: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 codes and their float64 scales (scale = max|w| / levels).

    levels: the largest code (default WEIGHT_LEVELS: 127, or 63 on a CPU without VNNI). The codes are
    those `torch.quantize_per_channel` makes (w times the float32 reciprocal of the scale, rounded
    half to even; a test holds them equal), computed with plain tensor ops in a quarter of its time:
    on the 135M model the int8 draft is built at start-up.
    """
    levels = WEIGHT_LEVELS if levels is None else int(levels)
    w = w.detach().float().contiguous()
    scale = (w.abs().amax(1) / float(levels)).clamp(min=1e-12).double()
    codes = torch.round(w * (1.0 / scale).float()[:, None]).clamp_(-levels - 1, levels).to(torch.int8)
    return codes, scale


def _int8_pack(w: torch.Tensor, bias: torch.Tensor | None = None):
    """Per-output-channel symmetric int8 weights, prepacked for the dynamic-quantisation kernel."""
    codes, scale = _int8_codes(w)
    zero = torch.zeros(w.shape[0], dtype=torch.long, device=w.device)
    with warnings.catch_warnings():     # quantised tensors are deprecated in favour of torchao (torch is pinned)
        warnings.simplefilter("ignore", UserWarning)
        q = torch._make_per_channel_quantized_tensor(codes, scale, zero, 0)
    return torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())


def _int8_linear(x: torch.Tensor, packed, bias=None) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(x, packed, False)


def _draft_linear(x: torch.Tensor, w, bias=None) -> torch.Tensor:
    """An int8 draft's matmul: the int8 kernel for prepacked weights (their bias is inside), `F.linear`
    for a plain tensor — the dequantised int8-rounded weights where there is no int8 kernel (CUDA)."""
    return F.linear(x, w, bias) if isinstance(w, torch.Tensor) else _int8_linear(x, w)


def _int8_rounded(w: torch.Tensor) -> torch.Tensor:
    """The same int8 codes, dequantised to w's dtype (any device)."""
    codes, scale = _int8_codes(w, 127)         # no int8 kernel here, so no saturation to avoid
    return (codes.float() * scale.float()[:, None]).to(w.dtype).contiguous()


def pack_int8(jobs: list[tuple], kernel: bool) -> list:
    """Pack (weight, bias) pairs; the CPU prepack runs in two threads (torch ops release the GIL)."""
    if not kernel:
        return [_int8_rounded(w) for w, _ in jobs]
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda job: _int8_pack(*job), jobs))


class DraftLayer:
    """One decoder layer's draft weights: the same norms, int8 matmuls (CPU kernel: biases prepacked;
    elsewhere the int8-rounded weights dequantised, with the biases kept apart). bdown: the MLP's
    output bias, which only a mean-compensated cut MLP has (drafts.mlp_weights)."""

    __slots__ = ("ln1", "wqkv", "bqkv", "wo", "ln2", "wgu", "wdown", "bdown")

    def __init__(self, layer, packed: list, bdown: torch.Tensor | None = None):
        """packed: qkv, o, gate/up, down: prepacked int8 weights (their biases inside) or plain tensors."""
        self.ln1, self.ln2 = layer.ln1, layer.ln2
        self.wqkv, self.wo, self.wgu, self.wdown = packed
        self.bqkv = layer.bqkv if isinstance(self.wqkv, torch.Tensor) else None
        self.bdown = bdown if isinstance(self.wdown, torch.Tensor) else None

    @staticmethod
    def jobs(layer, kernel: bool) -> list[tuple]:
        """(weight, bias to pack with it) for qkv, o, gate/up and down, in the order __init__ takes them."""
        return [(layer.wqkv, layer.bqkv if kernel else None), (layer.wo, None), (layer.wgu, None),
                (layer.wdown, None)]


@dataclass(frozen=True)
class DraftHead:
    """The draft's lm_head: all tokens, or the `ids` subset (scattered back to full-vocab logits)."""

    weight: object                      # fp32 tensor or int8 packed weights (rows = ids)
    ids: torch.Tensor | None            # None → the full vocabulary
    vocab: int
    linear: object

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x, self.weight, None)
        if self.ids is None:
            return out
        full = torch.full((*out.shape[:-1], self.vocab), float("-inf"), dtype=out.dtype, device=out.device)
        return full.index_copy_(-1, self.ids, out)

    @property
    def size(self) -> int:
        return self.vocab if self.ids is None else int(self.ids.numel())


class DraftWeights:
    """What a draft pass reads instead of the verifier's weights (see the module docstring)."""

    def __init__(self, backbone, kind: str = DEFAULT_DRAFT_KIND, head_ids=None, int8_kernel: bool | None = None):
        """int8_kernel: run int8 through PyTorch's CPU kernel (None: exactly when the model is on the CPU);
        False keeps dequantised int8-rounded weights instead (the path for CUDA, which tests run on a CPU)."""
        if kind not in DRAFT_KINDS:
            raise ValueError(f"unknown draft kind {kind!r}; choose one of {', '.join(DRAFT_KINDS)}")
        self.kind = kind
        self.channels: tuple[str, float] | None = None     # (ranking, keep) of a cut draft (drafts.cut_draft)
        self.compensated = False            # a cut draft whose MLPs add the dropped channels' mean
        device = backbone.device
        self.kernel = device.type == "cpu" if int8_kernel is None else bool(int8_kernel)
        dtype = str(backbone.dtype).replace("torch.", "")
        # what the label adds when the int8 draft cannot use the int8 kernel (honest about its speed)
        self.where = "" if kind != "int8" or self.kernel else \
            f"int8-rounded weights run in {dtype} on {device.type}: no int8 kernel there"
        ids = None
        if head_ids is not None and len(head_ids) < backbone.vocab:
            ids = torch.as_tensor(sorted({int(i) for i in head_ids}), dtype=torch.long, device=device)
            if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= backbone.vocab:
                raise ValueError(f"draft head ids must lie in 0..{backbone.vocab - 1}")
        head_w = backbone.lm_head if ids is None else backbone.lm_head[ids].contiguous()
        if kind == "int8":              # the head first: the largest matrix, so the two threads end together
            jobs = [(head_w, None)] + [job for layer in backbone.layers for job in DraftLayer.jobs(layer, self.kernel)]
            packed = pack_int8(jobs, self.kernel)
            self.layers = [DraftLayer(layer, packed[1 + 4 * i:5 + 4 * i]) for i, layer in enumerate(backbone.layers)]
            self.linear = _draft_linear
            self.head = DraftHead(packed[0], ids, backbone.vocab, self.linear)
        else:
            self.layers = backbone.layers
            self.linear = F.linear
            self.head = DraftHead(head_w, ids, backbone.vocab, F.linear)

    @property
    def label(self) -> str:
        """Plain words for the UI: "int8 draft, 8k-token head"."""
        head = "" if self.head.ids is None else f", {self.head.size / 1000:.0f}k-token head"
        if self.channels is not None:
            head += f", {self.channels[1]:.0%} of MLP channels ({self.channels[0]})" + \
                    (", the rest as their mean" if self.compensated else "")
        return f"{self.kind} draft{head}" + (f" ({self.where})" if self.where else "")

    def extra_bytes(self, mlp_only: bool = False) -> int:
        """Memory the draft holds beside the fp32 weights (int8 weights + scales, and copies: dequantised
        int8, cut MLPs, a small head). mlp_only: only its MLP matrices (a cut draft's own; its head and
        attention are the uncut draft's objects)."""
        copies = self.kind == "int8" and not self.kernel          # dequantised int8-rounded weights
        total = 0
        for layer in self.layers:
            for name in ("wgu", "wdown") if mlp_only else ("wqkv", "wo", "wgu", "wdown"):
                total += _held_bytes(getattr(layer, name), copies or (self.channels is not None
                                                                      and name in ("wgu", "wdown")))
        if not mlp_only:
            total += _held_bytes(self.head.weight, copies or self.head.ids is not None)
        return total


def _held_bytes(w, copy: bool) -> int:
    """Bytes a draft matrix adds: prepacked int8 (codes + 8 bytes of scale and zero point a row), or a
    plain tensor when it is the draft's own copy (not the verifier's weights)."""
    if not isinstance(w, torch.Tensor):
        q, _ = torch.ops.quantized.linear_unpack(w)
        return q.numel() + 8 * q.shape[0]
    return int(w.numel()) * w.element_size() if copy else 0


def frequent_tokens(counts: dict[int, int] | torch.Tensor, n: int, always=()) -> list[int]:
    """The `n` most frequent token ids (ties by id), plus `always` (e.g. EOS)."""
    if torch.is_tensor(counts):
        order = torch.argsort(-counts.float(), stable=True)[:n].tolist()
    else:
        order = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]]
    return sorted(set(int(t) for t in order) | set(int(t) for t in always))
