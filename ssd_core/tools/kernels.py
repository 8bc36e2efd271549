"""Which matmul kernel should the draft use on this CPU? One token through each of the model's matrices.

    python -m ssd_core.tools.kernels [--threads 2] [--out assets/bench/kernels.json]

Candidates, all in PyTorch's CPU build: fp32 `F.linear` (the verifier's own), bf16 weights,
`_weight_int8pack_mm` (int8 weights; fp32 or bf16 activations), `_weight_int4pack_mm_for_cpu`
(groupwise int4, group 32 like the GGUF's Q4_1 blocks; fp32 or bf16 activations) and the dynamic
quantisation kernel `quantized::linear_dynamic` (int8 weights, activations quantised per call).
Times are the best of several rounds (noise on a shared CPU only ever adds time).
"""
from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from ..engine.draft import _int8_linear, _int8_pack

# one decoder layer's matrices and the lm_head of SmolLM2-135M (out × in)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}


def _best_us(fn, calls: int, rounds: int = 7) -> float:
    for _ in range(min(10, calls)):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return round(best * 1e6, 1)


def _int4(w: torch.Tensor, group: int = 32):
    """Groupwise asymmetric int4 (w ≈ scale·q + min per group), packed for the CPU int4 kernel."""
    n, k = w.shape
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.clamp(torch.round((g - lo[..., None]) / scale[..., None]), 0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    # the kernel computes (q − 8)·scale + zero: zero = min + 8·scale
    sz = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).contiguous()
    return packed, sz


def kernels(threads: int = 2, seed: int = 0) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.05
        x = torch.randn(1, k)
        calls = 20 if name == "lm_head" else 200
        scale = w.abs().amax(1) / 127
        q8 = torch.round(w / scale[:, None]).to(torch.int8)
        wb = w.to(torch.bfloat16)
        packed4, sz4 = _int4(w)
        dyn = _int8_pack(w)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row = {
                "fp32": _best_us(lambda: F.linear(x, w), calls),
                "bf16_weights": _best_us(lambda: F.linear(x.to(torch.bfloat16), wb).float(), calls),
                "int8pack_fp32_act": _best_us(lambda: torch._weight_int8pack_mm(x, q8, scale), calls),
                "int8pack_bf16_act": _best_us(lambda: torch._weight_int8pack_mm(
                    x.to(torch.bfloat16), q8, scale.to(torch.bfloat16)).float(), calls),
                "int4pack_fp32_act": _best_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x, packed4, 32, sz4), calls),
                "int4pack_bf16_act": _best_us(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
                    x.to(torch.bfloat16), packed4, 32, sz4.to(torch.bfloat16)).float(), calls),
                "int8_dynamic": _best_us(lambda: _int8_linear(x, dyn), calls),
            }
        out[name] = {"shape": [n, k], "us": row,
                     "vs_fp32": {kk: round(row["fp32"] / v, 2) for kk, v in row.items()}}
    return {"threads": threads, "torch": torch.__version__, "note": "µs per call, one token; vs_fp32 > 1 "
            "means faster than fp32", "matrices": out}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the JSON here as well")
    args = ap.parse_args(argv)
    res = kernels(args.threads)
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    for name, m in res["matrices"].items():
        print(f"{name:8s} " + "  ".join(f"{k} {v}x" for k, v in m["vs_fp32"].items()))


if __name__ == "__main__":
    main()
