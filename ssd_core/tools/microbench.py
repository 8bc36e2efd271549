"""Core speed in llama-bench's units: decode-only tokens/s, same process, interleaved rounds.

    python -m ssd_core.tools.microbench --max-new-tokens 128 --out assets/bench/core.json

Three figures per round, rounds interleaved so drift on a shared CPU hits all alike; each reported
figure is the median over rounds (at least 5 by default):

- `generate` and `core_ar`: plain greedy decoding of a short prompt (~30 tokens of context), EOS off,
  `--max-new-tokens` tokens, prefill excluded, like `llama-bench -p 0 -n 128`: transformers'
  `generate` (its prefill measured by a one-token `generate` and subtracted) and the core's own loop.
- `ssd`: the decoding `make run` serves (the default calibration's `knn` strategy, int8 draft, prompt
  lookup, adaptive γ) over one held-out prompt per category (`assets/bench/heldout_questions.jsonl`),
  EOS on (text generated past EOS repeats itself and flatters lookup), prefill excluded; `heldout.core_ar`
  is plain decoding of the same prompts under the same rules, and `ssd_vs_core_ar` their ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..calibration import artifact
from ..engine.decode import DecodeConfig
from ..engine.generate import generate
from ..engine.loading import load_backbone
from ..engine.machine import cpu_info
from ..engine.skipset import SkipSet
from ..policies import registry
from ..policies.ar import Autoregressive

SHORT_PROMPT = "Explain in a few sentences why the sky looks blue during the day."
HELDOUT = Path("assets/bench/heldout_questions.jsonl")


def example_skip(n_layers: int) -> SkipSet:
    """A fixed illustrative set: every other middle MLP and a few middle attentions."""
    mid = range(n_layers // 4, 3 * n_layers // 4)
    return SkipSet(frozenset(list(mid)[::4]), frozenset(list(mid)[1::3]), name="example")


def _hf_generate_s(bb, ids: torch.Tensor, n: int) -> float:
    with torch.inference_mode():
        t = time.perf_counter()
        bb.hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t


def hf_decode_tps(bb, prompt: str, n: int) -> float:
    """transformers' generate, decode only: (n − 1) tokens ÷ (time for n − time for 1)."""
    ids = torch.tensor([bb.encode(prompt).ids], device=bb.device)
    return (n - 1) / max(1e-9, _hf_generate_s(bb, ids, n) - _hf_generate_s(bb, ids, 1))


def decode_tps(runs) -> float:
    """Tokens after the first ÷ seconds after the prefill, summed over generations (llama-bench's tg)."""
    return sum(g.stats.new_tokens - 1 for g in runs) / max(1e-9, sum(g.stats.wall_s - g.stats.prefill_s for g in runs))


def heldout_prompts(path: Path = HELDOUT) -> list[str]:
    """The first prompt of each category of the held-out question file (one per category)."""
    first: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            first.setdefault(q["category"], q["turns"][0])
    return list(first.values())


def run(model: str | None, n: int, rounds: int, calibration: str | None = None) -> dict:
    bb = load_backbone(model, threads=torch.get_num_threads())
    cal = artifact.load(artifact.default_folder(calibration or model), bb)
    plain = DecodeConfig(max_new_tokens=n, stop_at_eos=False)
    served = DecodeConfig(max_new_tokens=n, max_prompt_tokens=1024)      # the app's decoding, EOS on
    prompts = heldout_prompts()
    figures = {"generate": [], "core_ar": [], "ssd": [], "heldout_core_ar": []}
    ssd_runs = []
    hf_decode_tps(bb, SHORT_PROMPT, 8)                  # warm-up: both paths, every pass shape
    generate(bb, SHORT_PROMPT, registry.build(cal, "knn"), served)
    for _ in range(rounds):
        figures["generate"].append(hf_decode_tps(bb, SHORT_PROMPT, n))
        figures["core_ar"].append(decode_tps([generate(bb, SHORT_PROMPT, Autoregressive(), plain)]))
        ar = [generate(bb, p, Autoregressive(), served) for p in prompts]
        ssd = [generate(bb, p, registry.build(cal, "knn"), served) for p in prompts]
        if any(a.token_ids != b.token_ids for a, b in zip(ar, ssd)):
            raise SystemExit("speculative output differs from plain decoding: not lossless")
        figures["heldout_core_ar"].append(decode_tps(ar))
        figures["ssd"].append(decode_tps(ssd))
        ssd_runs += [g.stats for g in ssd]
    med = {k: statistics.median(v) for k, v in figures.items()}
    paired = round(statistics.median(s / a for s, a in zip(figures["ssd"], figures["heldout_core_ar"])), 3)
    gb = bb.weight_bytes() / 1e9
    step_time = sum(s.draft_s + s.verify_s + s.overhead_s for s in ssd_runs)
    return {
        "model": bb.name, "threads": torch.get_num_threads(), "torch": torch.__version__, "cpu": cpu_info(),
        "kernel": bb.kernel, "max_new_tokens": n, "rounds": rounds, "statistic": "median over rounds",
        "calibration": str(cal.folder), "strategy": "knn",
        "tokens_per_s": {k: round(med[k], 2) for k in ("generate", "core_ar", "ssd")},
        "heldout": {"prompts": len(prompts), "core_ar": round(med["heldout_core_ar"], 2),
                    "ssd": round(med["ssd"], 2), "ssd_vs_core_ar": paired},
        "core_ar_vs_generate": round(statistics.median(a / g for a, g in zip(figures["core_ar"], figures["generate"])), 3),
        "ssd_vs_core_ar": paired,           # the median of each round's own ratio (same prompts, same round)
        "weights_gb_per_step": round(gb, 3),
        "bandwidth_gb_s": {"generate": round(gb * med["generate"], 1), "core_ar": round(gb * med["core_ar"], 1)},
        "ssd_tau": round(sum(s.tau for s in ssd_runs) / len(ssd_runs), 3),
        "ssd_alpha": round(sum(s.alpha for s in ssd_runs) / len(ssd_runs), 3),
        "ssd_non_forward_share": round(sum(s.overhead_s for s in ssd_runs) / step_time, 4),
        "samples": {k: [round(x, 2) for x in v] for k, v in figures.items()},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model spec (default: embedded SmolLM2-135M)")
    ap.add_argument("--calibration", default=None, help="calibration folder (default: the one `make run` serves)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="assets/bench/core.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    res = run(args.model, args.max_new_tokens, args.rounds, args.calibration)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({k: res[k] for k in ("kernel", "tokens_per_s", "heldout", "core_ar_vs_generate",
                                          "bandwidth_gb_s", "ssd_tau", "ssd_non_forward_share")}, indent=2))


if __name__ == "__main__":
    main()
