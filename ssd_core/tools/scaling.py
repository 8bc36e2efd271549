"""Scaling: decode tokens/s against prompt length for ar, knn and knapspec, and KnapSpec's choice.

    python -m ssd_core.scaling --out assets/bench/scaling

Prompts of about 256, 1k, 2k and 4k tokens are cut from this project's own summarization domain
texts (assets/domains/summarization.jsonl) under one "Summarize" instruction. Each length runs
ar, then knn, then knapspec on the same prompt ids (interleaved, after a warm-up), for a fixed
number of new tokens (no EOS stop, so every run commits the same count). KnapSpec re-chooses its
skip set from the live context; its choices are recorded, and a sweep of the knapsack over
context lengths with one fixed similarity profile isolates the cost side: attention sublayers get
dearer with context, MLPs do not.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..calibration import artifact as cal_io
from ..calibration.domains import DOMAIN_DIR, load_prompts
from ..engine.backbone import EMPTY, Backbone
from ..engine.decode import DecodeConfig
from ..engine.device import add_device_argument, device_label
from ..engine.generate import generate
from ..engine.loading import load_backbone
from ..engine.prompt import PromptIds
from ..policies.knapspec import choose_skip, knapsack_min_loss, prompt_similarity
from ..policies.registry import BASELINE, build as build_strategy, parse_strategies
from .metrics import DEFINITIONS as BENCH_DEFINITIONS
from .metrics import group_stats, machine, round_or_none

LENGTHS = (256, 1024, 2048, 4096)
SWEEP = (128, 256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8000)
SAVINGS = (0.15, 0.30)        # fixed shares of a full step's time for the composition sweep
INSTRUCTION = "Summarize the following news reports in a few sentences.\n\n"
DEFAULT_STRATEGIES = (BASELINE, "knn", "knapspec")

DEFINITIONS = {
    "prompt_tokens": "length of the templated prompt the model prefills (chat template included)",
    "decode_tokens_per_s": BENCH_DEFINITIONS["decode_tokens_per_s"],
    "tokens_per_s": BENCH_DEFINITIONS["tokens_per_s"],
    "decode_speedup": "decode_tokens_per_s ÷ ar's, same prompt ids, same run",
    "tau": BENCH_DEFINITIONS["tau"], "alpha": BENCH_DEFINITIONS["alpha"],
    "skip_sets": "knapspec: the set it chose each time it re-optimised (attention + MLP sublayers "
                 "skipped, at the context length it chose for); knn: the routed domain's set",
    "fixed_saving_sweep": "KnapSpec's knapsack asked for the least-loss set that saves a fixed share of "
                          "a full step's time (same fixed similarity profile): how many attention vs MLP "
                          "sublayers make up that saving as attention gets dearer",
    "knapspec_sweep": "choose_skip(latency, similarity, context) with the similarity profile of the "
                      "shortest prompt held fixed: the choice as only the cost of attention changes "
                      "(the latency model is linear in context, fitted on its profiled contexts and "
                      "extrapolated beyond them)",
}


def source_paragraphs(domain_dir: Path | str = DOMAIN_DIR) -> list[str]:
    """The project's own news paragraphs (the summarization domain prompts without their prefix)."""
    out = []
    for p in load_prompts(domain_dir, ("summarization",))["summarization"]:
        head, sep, rest = p.partition(":")
        out.append(rest.strip() if sep and head.lower().startswith("summar") else p.strip())
    return out


def long_prompt(backbone: Backbone, target_tokens: int, paragraphs: list[str], offset: int = 0) -> PromptIds:
    """A "Summarize" prompt of about `target_tokens` templated tokens, paragraphs from `offset` on."""
    tok = backbone.tokenizer
    overhead = len(backbone.encode(INSTRUCTION.strip()))
    want = max(8, target_tokens - overhead)
    body: list[int] = []
    i = offset
    while len(body) < want:                         # cycles through the paragraphs if it must
        body += tok(paragraphs[i % len(paragraphs)] + "\n\n", add_special_tokens=False).input_ids
        i += 1
    return backbone.encode(INSTRUCTION + tok.decode(body[:want]).strip())


def _choice(skip, predicted_speedup: float, acceptance: float) -> dict:
    return {"attn": len(skip.attn), "mlp": len(skip.mlp), "attn_layers": sorted(skip.attn),
            "mlp_layers": sorted(skip.mlp), "predicted_speedup": round_or_none(predicted_speedup),
            "acceptance": round_or_none(acceptance)}


def skip_sets(generation) -> list[dict]:
    """The sets a run drafted with, from its events: each re-optimisation's choice (knapspec), or
    the set it planned at the start (knn: the routed domain's)."""
    forecasts = [s.forecast for s in generation.steps if s.forecast is not None]
    if forecasts:
        return [{"context_len": f.context_len, **_choice(f.skip, f.predicted_speedup, f.acceptance)}
                for f in forecasts]
    start = generation.start
    if start.skip is None:
        return []
    return [{"domain": start.domain, "attn": len(start.skip.attn), "mlp": len(start.skip.mlp)}]


def knapspec_sweep(calibration, attn_sim, mlp_sim, contexts, gamma: int) -> list[dict]:
    kappa = calibration.knapspec.get("kappa", 8.0)
    lat = calibration.latency
    out = []
    for c in contexts:
        ch = choose_skip(lat, attn_sim, mlp_sim, c, gamma, kappa)
        out.append({"context_len": c, "attn_ms": round_or_none(1000 * lat.attn_time(c)),
                    "mlp_ms": round_or_none(1000 * lat.mlp),
                    **_choice(ch.skip, ch.predicted_speedup, ch.acceptance)})
    return out


def fixed_saving_sweep(calibration, attn_sim, mlp_sim, contexts, savings=SAVINGS, bins: int = 240,
                       protect=None) -> list[dict]:
    """Per context and saving share: the least-loss skip set (KnapSpec's items, weights and losses)."""
    lat = calibration.latency
    L = lat.n_layers
    protect = {0, L - 1} if protect is None else set(protect)
    out = []
    for c in contexts:
        unit = lat.step_time(EMPTY, c) / bins
        items = [("attn", i) for i in range(L) if i not in protect] + \
                [("mlp", i) for i in range(L) if i not in protect]
        weights = [max(1, round((lat.attn_time(c) if k == "attn" else lat.mlp) / unit)) for k, _ in items]
        losses = [max(0.0, 1.0 - float((attn_sim if k == "attn" else mlp_sim)[i])) for k, i in items]
        row = {"context_len": c}
        for share in savings:
            target = int(round(bins * share))
            best, choose = knapsack_min_loss(weights, losses, min(sum(weights), target + 3))
            feasible = [w for w in range(target, len(best)) if best[w] < float("inf")]
            if not feasible:
                row[f"{share:.2f}"] = None
                continue
            w = min(feasible, key=lambda x: best[x])
            chosen = [items[j] for j in choose(w)]
            row[f"{share:.2f}"] = {"attn": sum(k == "attn" for k, _ in chosen),
                                   "mlp": sum(k == "mlp" for k, _ in chosen), "loss": round_or_none(best[w])}
        out.append(row)
    return out


def findings(result: dict, calibration) -> list[str]:
    """Plain sentences: where KnapSpec's choice changes (sweep and measured runs)."""
    lat = calibration.latency
    out = []
    if lat.attn_b > 0 and lat.mlp > lat.attn_a:
        cross = (lat.mlp - lat.attn_a) / lat.attn_b
        out.append(f"Latency model: one attention sublayer costs {1000 * lat.attn_a:.3f} ms + "
                   f"{1e6 * lat.attn_b:.3f} µs per context token, an MLP sublayer {1000 * lat.mlp:.3f} ms; "
                   f"attention becomes the dearer sublayer at about {cross:.0f} tokens of context.")
    else:
        out.append(f"Latency model: attention {1000 * lat.attn_a:.3f} ms + {1e6 * lat.attn_b:.3f} µs/token, "
                   f"MLP {1000 * lat.mlp:.3f} ms per sublayer.")
    sweep = result.get("knapspec_sweep") or []
    if sweep:
        changes = [(a, b) for a, b in zip(sweep, sweep[1:]) if (a["attn"], a["mlp"]) != (b["attn"], b["mlp"])]
        if not changes:
            out.append(f"Sweep (fixed similarity): KnapSpec skips {sweep[0]['attn']} attention + "
                       f"{sweep[0]['mlp']} MLP sublayers at every context from {sweep[0]['context_len']} to "
                       f"{sweep[-1]['context_len']}: its choice does not change with context on this model.")
        for a, b in changes:
            out.append(f"Sweep (fixed similarity): between {a['context_len']} and {b['context_len']} tokens "
                       f"KnapSpec goes from {a['attn']} attention + {a['mlp']} MLP to {b['attn']} attention + "
                       f"{b['mlp']} MLP sublayers skipped (attention {a['attn_ms']:.3f} → {b['attn_ms']:.3f} "
                       f"ms per sublayer; predicted {a['predicted_speedup']:.2f}× → {b['predicted_speedup']:.2f}×).")
    fixed = result.get("fixed_saving_sweep") or []
    for share in SAVINGS:
        key = f"{share:.2f}"
        rows = [r for r in fixed if r.get(key)]
        if not rows:
            continue
        mixes = [(r["context_len"], r[key]["attn"], r[key]["mlp"]) for r in rows]
        moves = [(a, b) for a, b in zip(mixes, mixes[1:]) if a[1:] != b[1:]]
        text = ", ".join(f"{c}: {a}+{m}" for c, a, m in mixes)
        if moves:
            first = moves[0]
            out.append(f"Saving {100 * share:.0f}% of a step at least loss (context: attention+MLP skipped) — "
                       f"{text}. The mix first changes between {first[0][0]} and {first[1][0]} tokens.")
        else:
            out.append(f"Saving {100 * share:.0f}% of a step at least loss: {mixes[0][1]} attention + "
                       f"{mixes[0][2]} MLP sublayers at every context ({mixes[0][0]}–{mixes[-1][0]}).")
    measured = []
    for p in result["points"]:
        sets = p["strategies"].get("knapspec", {}).get("skip_sets") or []
        if sets:
            measured.append(f"{p['prompt_tokens']} → {sets[0]['attn']}+{sets[0]['mlp']}")
    if measured:
        out.append("Measured runs, KnapSpec's first choice (prompt tokens → attention + MLP skipped): "
                   + "; ".join(measured) + ".")
    return out


def run_scaling(backbone: Backbone, calibration, lengths=LENGTHS, new_tokens: int = 48,
                gamma: int | None = None, repeats: int = 1, strategies=DEFAULT_STRATEGIES,
                sweep_contexts=SWEEP, warmup: bool = True, progress: bool = True) -> dict:
    gamma = int(gamma or calibration.meta.get("settings", {}).get("gamma", 4))
    names = parse_strategies(strategies)
    room = backbone.max_positions - new_tokens - gamma - 2
    lengths = [n for n in lengths if n <= room]
    if not lengths:
        raise ValueError(f"no length fits the model's {backbone.max_positions} positions")
    cfg = DecodeConfig(max_new_tokens=new_tokens, gamma=gamma, stop_at_eos=False)
    paragraphs = source_paragraphs()
    machine_info = machine()
    t0 = time.perf_counter()
    prompts = {(n, r): long_prompt(backbone, n, paragraphs, offset=7 * r) for n in lengths for r in range(repeats)}
    if warmup:
        first = prompts[(lengths[0], 0)]
        for name in names:
            generate(backbone, first, build_strategy(calibration, name, gamma=gamma),
                     DecodeConfig(max_new_tokens=min(8, new_tokens), gamma=gamma, stop_at_eos=False))
    bar = tqdm(total=len(prompts) * len(names), desc="scaling", unit="run", disable=not progress)
    points, failures = [], []
    for n in lengths:
        recs = {name: [] for name in names}
        sets = {name: [] for name in names}
        for r in range(repeats):
            ids = prompts[(n, r)]
            ar_ids = None
            for name in names:
                bar.set_postfix_str(f"{len(ids)} tokens {name}")
                g = generate(backbone, ids, build_strategy(calibration, name, gamma=gamma), cfg)
                st = g.stats
                recs[name].append({"new_tokens": st.new_tokens, "wall_s": st.wall_s, "prefill_s": st.prefill_s,
                                   "accept_lengths": list(st.accept_lengths), "drafted": st.drafted,
                                   "accepted": st.accepted})
                sets[name] += skip_sets(g)
                if name == BASELINE:
                    ar_ids = g.token_ids
                elif g.token_ids != ar_ids:
                    failures.append({"prompt_tokens": len(ids), "strategy": name, "repeat": r})
                bar.update()
        point = {"target_tokens": n,
                 "prompt_tokens": round(sum(len(prompts[(n, r)]) for r in range(repeats)) / repeats),
                 "strategies": {}}
        for name in names:
            point["strategies"][name] = {
                **group_stats(recs[name], recs[BASELINE]),
                "prefill_s": round_or_none(sum(x["prefill_s"] for x in recs[name]) / len(recs[name]), 3),
                "skip_sets": sets[name],
            }
        points.append(point)
    bar.close()
    short = prompts[(lengths[0], 0)]
    attn_sim, mlp_sim = prompt_similarity(backbone, short.ids)
    sweep = [c for c in sweep_contexts if c <= backbone.max_positions]
    machine_info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result = {
        "model": backbone.name, "device": device_label(backbone.device), "lossless": not failures,
        "lossless_failures": failures,
        "points": points,
        "knapspec_sweep": knapspec_sweep(calibration, attn_sim, mlp_sim, sweep, gamma),
        "fixed_saving_sweep": fixed_saving_sweep(calibration, attn_sim, mlp_sim, sweep),
        "latency_model": {"attn_a_ms": round_or_none(1000 * calibration.latency.attn_a, 5),
                          "attn_b_us_per_token": round_or_none(1e6 * calibration.latency.attn_b, 5),
                          "mlp_ms": round_or_none(1000 * calibration.latency.mlp, 5),
                          "profiled_contexts": [p["context"] for p in calibration.latency.measured]},
        "settings": {"lengths": list(lengths), "new_tokens": new_tokens, "gamma": gamma, "repeats": repeats,
                     "strategies": names, "stop_at_eos": False, "greedy": True,
                     "source": "assets/domains/summarization.jsonl"},
        "machine": machine_info, "total_s": round(time.perf_counter() - t0, 1),
        "definitions": DEFINITIONS,
    }
    result["findings"] = findings(result, calibration)
    return result


def write_outputs(result: dict, out_dir) -> Path:
    """scaling.json (data only; `python -m viz.bench_figures` draws it)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "scaling.json"
    path.write_text(json.dumps(result, indent=1), encoding="utf-8")
    return path


def main(argv=None, backbone: Backbone | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--calibration", default=None, help="calibration folder (default: assets/calibration/<slug>)")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="target prompt lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=1, help="prompts per length (different text)")
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", default="assets/bench/scaling")
    add_device_argument(ap)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    bb = backbone or load_backbone(args.model, threads=args.threads, device=args.device)
    folder = Path(args.calibration) if args.calibration else cal_io.default_folder(args.model)
    cal = cal_io.load(folder, bb)
    result = run_scaling(bb, cal, [int(x) for x in args.lengths.split(",")], args.new_tokens, args.gamma,
                         args.repeats, [s.strip() for s in args.strategies.split(",") if s.strip()],
                         progress=not args.no_progress)
    path = write_outputs(result, args.out)
    print(json.dumps(result["points"], indent=1))
    print(f"\nwrote {path}; tables and figures: python -m viz.bench_figures {args.out}")
    if not result["lossless"]:
        print(f"LOSSLESS FAILURE: {result['lossless_failures']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
