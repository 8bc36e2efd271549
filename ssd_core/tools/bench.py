"""Spec-Bench-compatible benchmark: τ, α and speedup per category for every strategy, one process.

    python -m ssd_core.bench --questions assets/bench/sample_questions.jsonl \
        --strategies ar,static,knn,oracle,knapspec --max-new-tokens 64 --out assets/bench/sample_run

Input: Spec-Bench's question format (one JSON object a line: question_id, category, turns; the
first turn is the prompt). Output, in --out: `<strategy>.jsonl` in Spec-Bench's answer format and
`summary.json` (the figures are defined in tools.metrics.DEFINITIONS). Tables and plotly figures
come from the views: `python -m viz.bench_figures OUT` writes `results.md` and the figures.

Fairness: every strategy runs in this one process, interleaved per prompt (`ar`, then
`model.generate`, then each other strategy on the same prompt ids), after a warm-up, so machine
drift hits all of them alike. Speedups are ratios against this run's `ar`, reported as measured.
Lossless check: every strategy's greedy tokens and text must equal `ar`'s, and `ar`'s tokens must
equal transformers' greedy `model.generate` wherever it ran (an independent reference for the core's
own forward); if not, the run says which prompt and strategy, and exits with status 1.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..calibration import artifact as cal_io
from ..calibration import profiles
from ..calibration.latency import expected_tokens
from ..engine.backbone import Backbone
from ..engine.decode import DecodeConfig
from ..engine.device import add_device_argument, device_label
from ..engine.draft import DRAFT_KINDS
from ..engine.generate import generate
from ..engine.loading import ModelNotFoundError, load_backbone
from ..engine.trace import record as record_trace
from ..policies.oracle import ORACLE_CATEGORY_DOMAIN
from ..policies.registry import BASELINE, SPECULATIVE, STRATEGIES, build as build_strategy, parse_strategies
from . import batch_bench
from .specbench import Question, answer_line, load_questions, mix_order, select, switch_rate
from .reference import hf_generate
from .metrics import (DEFINITIONS, aggregate, combine_predictions, draft_memory, first_difference, group_stats,
                    machine, median_speedup, round_or_none)


# --- one run of one strategy on one prompt ------------------------------------------------------------
def _record(gen, name: str, question: Question, prompt_ids, calibration, gamma: int,
            kind: str = "fp32") -> dict:
    """Everything the summary and the answer file need from one Generation."""
    st = gen.stats
    spec_steps = [s for s in gen.steps if s.skip is not None]
    skip = Counter(s.skip for s in spec_steps).most_common(1)[0][0] if spec_steps else None
    ctx = (sum(s.context_len for s in gen.steps) / len(gen.steps)) if gen.steps else len(prompt_ids)
    pred_measured, pred_calib, calib_acc = 1.0, 1.0, None
    if skip is not None:
        lat = calibration.latency
        pred_measured = lat.predicted_run_speedup(gen.steps, kind)    # the cost model alone: acceptance as it happened
        calib_acc = calibration.acceptance(kind).get(skip.name)
        if calib_acc is None:          # knapspec: its own exp(−κ·loss) estimate for that set
            for f in (s.forecast for s in gen.steps if s.forecast is not None):
                if (f.skip.attn, f.skip.mlp) == (skip.attn, skip.mlp):
                    calib_acc = f.acceptance
        if calib_acc is not None:
            g = lat.best_gamma(skip, calib_acc, gamma, int(ctx), kind)
            pred_calib = lat.expected_speedup(skip, calib_acc, g, int(ctx), kind)
        else:
            pred_calib = None
    return {
        "question_id": question.question_id, "category": question.category,
        "strategy": name, "token_ids": gen.token_ids, "text": gen.text,
        "new_tokens": st.new_tokens, "wall_s": st.wall_s, "prefill_s": st.prefill_s,
        "steps": st.steps, "drafted": st.drafted, "accepted": st.accepted,
        "accept_lengths": list(st.accept_lengths), "prompt_tokens": len(prompt_ids),
        "lookup_steps": sum(1 for s in gen.steps if s.source == "lookup"),
        "lookup_accepted": sum(s.accepted for s in gen.steps if s.source == "lookup"),
        "domain": gen.start.domain, "skip": skip.to_dict() if skip is not None else None,
        "context_len": ctx, "calibration_acceptance": calib_acc,
        "predicted_speedup_measured_alpha": pred_measured,
        "predicted_speedup_calibration_alpha": pred_calib,
        "tstamp": time.time(),
    }


# --- the benchmark ---------------------------------------------------------------------------------
@dataclass
class BenchRun:
    summary: dict
    answers: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def lossless(self) -> bool:
        return bool(self.summary["lossless"])


def run_bench(backbone: Backbone, calibration, questions: list[Question], strategies=(BASELINE, *SPECULATIVE),
              max_new_tokens: int = 64, gamma: int | None = None,
              max_prompt_tokens: int | None = None, mix_ratio: float = 0.0, seed: int = 0,
              hf_generate_every: int = 1, warmup: bool = True, progress: bool = True,
              settings: dict | None = None, draft: str = "int8", lookup: bool = True,
              adaptive: bool = True, traces=None) -> BenchRun:
    """Run every strategy on every question, interleaved per prompt; return the summary and answers.

    draft / lookup: the draft's weights and prompt-lookup drafts (DecodeConfig); adaptive: the
    latency model picks each step's draft length ≤ gamma; traces: a folder to write every run's
    trace to (`<strategy>/<question_id>.json`, the app's replay format).
    """
    names = parse_strategies(strategies)
    gamma = int(gamma or calibration.meta.get("settings", {}).get("gamma", 4))
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, gamma=gamma, seed=seed, draft=draft, lookup=lookup)
    memory = draft_memory(backbone, draft)
    order = mix_order(list(questions), mix_ratio, seed)
    if not order:
        raise ValueError("no questions to run")
    machine_info = {**machine(), "kernel": backbone.kernel}
    t_run = time.perf_counter()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    encoded = {id(q): backbone.encode(q.prompt, max_tokens=max_prompt_tokens) for q in order}
    for q in order:
        need = len(encoded[id(q)]) + max_new_tokens + gamma + 2
        if need > backbone.max_positions:
            raise ValueError(f"question {q.question_id}: {need} positions exceed the model's "
                             f"{backbone.max_positions}; lower --max-prompt-tokens")

    def fresh(name: str, q: Question):
        return build_strategy(calibration, name, gamma=gamma, category=q.category if name == "oracle" else None,
                                    draft=draft, adaptive=adaptive)

    hf_every = int(hf_generate_every or 0)
    if warmup:                                         # first prompt, every path, not recorded
        q = order[0]
        wcfg = replace(cfg, max_new_tokens=min(16, max_new_tokens))
        for name in names:
            generate(backbone, encoded[id(q)], fresh(name, q), wcfg)
        if hf_every:
            hf_generate(backbone, encoded[id(q)], min(16, max_new_tokens))

    records: dict[str, list[dict]] = {n: [] for n in names}
    hf_records, hf_strategy_records = [], {n: [] for n in names}
    failures, hf_agree = [], 0
    total = len(order) * len(names) + (len(range(0, len(order), hf_every)) if hf_every else 0)
    bar = tqdm(total=total, desc="bench", unit="run", disable=not progress)
    for i, q in enumerate(order):
        ids = encoded[id(q)]
        ar_rec = None
        run_hf = bool(hf_every) and i % hf_every == 0
        for name in names:
            bar.set_postfix_str(f"q{q.question_id} {q.category} {name}")
            strat = fresh(name, q)
            gen = generate(backbone, ids, strat, cfg)
            rec = _record(gen, name, q, ids, calibration, gamma, draft)
            rec["truncated"] = ids.truncated
            records[name].append(rec)
            if traces is not None:
                record_trace(backbone, q.prompt, name, cfg, gen.start, gen.steps, gen.stats.wall_s,
                             question_id=q.question_id, category=q.category, source="ssd_core.bench",
                             started=started).save(Path(traces) / name / f"{q.question_id}.json")
            if run_hf:
                hf_strategy_records[name].append(rec)
            bar.update()
            if name == BASELINE:
                ar_rec = rec
                # where the router sends this prompt (same prefill embedding the knn strategy sees)
                rec["domain"] = calibration.router.route(gen.start.embedding).domain
                if run_hf:                             # right after ar, on the same prompt ids
                    bar.set_postfix_str(f"q{q.question_id} {q.category} model.generate")
                    h = hf_generate(backbone, ids, max_new_tokens)
                    hf_records.append(h)
                    if h["token_ids"] == tuple(rec["token_ids"]):
                        hf_agree += 1
                    else:                              # the core's own reference is off
                        at = first_difference(rec["token_ids"], h["token_ids"])
                        failures.append({"question_id": q.question_id, "category": q.category,
                                         "strategy": "ar", "reference": "hf_generate",
                                         "first_difference_at_token": at,
                                         "reference_text": backbone.decode(h["token_ids"]),
                                         "text": rec["text"]})
                    bar.update()
            elif rec["token_ids"] != ar_rec["token_ids"] or rec["text"] != ar_rec["text"]:
                at = first_difference(rec["token_ids"], ar_rec["token_ids"])
                failures.append({"question_id": q.question_id, "category": q.category,
                                 "strategy": name, "reference": "ar", "first_difference_at_token": at,
                                 "reference_text": ar_rec["text"], "ar_text": ar_rec["text"],
                                 "text": rec["text"]})
    bar.close()

    summary = _summarise(backbone, calibration, names, order, records, hf_records, hf_strategy_records,
                         failures, gamma, hf_agree)
    machine_info["load_average_at_end"] = ([round(x, 2) for x in os.getloadavg()]
                                           if hasattr(os, "getloadavg") else None)
    summary.update(machine=machine_info, memory=memory, started=started, total_s=round(time.perf_counter() - t_run, 1))
    summary["settings"] = {"strategies": names, "max_new_tokens": max_new_tokens, "gamma": gamma,
                           "max_prompt_tokens": max_prompt_tokens, "mix_ratio": mix_ratio, "seed": seed,
                           "hf_generate_every": hf_every, "warmup": warmup, "stop_at_eos": True,
                           "greedy": True, "draft": draft, "lookup": lookup, "adaptive_gamma": adaptive,
                           "draft_label": (backbone.drafts.get(draft).label
                                           if backbone.drafts.get(draft) is not None else "fp32 draft"),
                           **(settings or {})}
    answers = {n: [answer_line(backbone.name, r) for r in records[n]] for n in names}
    return BenchRun(summary, answers)


def _group_stats(recs: list[dict], ar_recs: list[dict], gamma: int) -> dict:
    agg = aggregate(recs)
    return {
        **group_stats(recs, ar_recs),
        "speedup_median": round_or_none(median_speedup(recs, ar_recs)),
        "tau_iid_from_alpha": round_or_none(expected_tokens(agg["alpha"], gamma)) if agg["drafted"] else 1.0,
        "predicted_speedup_measured_alpha": round_or_none(
            combine_predictions(recs, "predicted_speedup_measured_alpha")),
        "predicted_speedup_calibration_alpha": round_or_none(
            combine_predictions(recs, "predicted_speedup_calibration_alpha")),
    }


def _summarise(backbone, calibration, names, order, records, hf_records, hf_strategy_records, failures,
               gamma, hf_agree) -> dict:
    cats = list(dict.fromkeys(q.category for q in order))
    ar = records[BASELINE]
    hf = aggregate(hf_records) if hf_records else None
    hf_tps = hf["tokens_per_s"] if hf else None
    strategies = {}
    for name in names:
        recs = records[name]
        s = _group_stats(recs, ar, gamma)
        if hf_tps:
            sub = aggregate(hf_strategy_records.get(name) or [])
            s["speedup_vs_hf_generate"] = round_or_none(sub["tokens_per_s"] / hf_tps) if sub["prompts"] else None
        s["accept_length_histogram"] = {str(k): v for k, v in
                                        sorted(Counter(n for r in recs for n in r["accept_lengths"]).items())}
        s["skip_sets"] = dict(Counter((r["skip"] or {}).get("name", "none") for r in recs))
        s["lookup_steps"] = sum(r.get("lookup_steps", 0) for r in recs)
        s["lookup_accepted"] = sum(r.get("lookup_accepted", 0) for r in recs)
        s["per_category"] = {c: _group_stats([r for r in recs if r["category"] == c],
                                             [r for r in ar if r["category"] == c], gamma) for c in cats}
        strategies[name] = s

    # routing: the knn strategy's own decisions; else the router on ar's (identical) prefill embedding
    source = "knn" if "knn" in records else "router on ar's prefill embedding"
    routing = {c: {} for c in cats}
    for r in records["knn" if "knn" in records else "ar"]:
        d = r["domain"] or "unknown"
        routing[r["category"]][d] = routing[r["category"]].get(d, 0) + 1
    oracle_domains = {c: ORACLE_CATEGORY_DOMAIN.get(c.lower(), "static") for c in cats}
    agree = [r for r in records["knn" if "knn" in records else "ar"]
             if oracle_domains[r["category"]] != "static"]
    ar_tps = aggregate(ar)["tokens_per_s"]
    truncated = [r["question_id"] for r in ar if r.get("truncated")]
    return {
        "model": backbone.name,
        "model_info": backbone.describe(), "device": device_label(backbone.device),
        "calibration": str(calibration.folder) if calibration.folder else None,
        "calibration_created": calibration.meta.get("created"),
        "lossless": not failures,
        "lossless_vs_ar": not any(f["reference"] == "ar" for f in failures),
        "lossless_vs_hf": not any(f["reference"] == "hf_generate" for f in failures) if hf_records else None,
        "lossless_failures": failures,
        "strategies": strategies,
        "categories": cats,
        "routing": routing,
        "routing_source": source,
        "routing_matches_oracle": (round_or_none(sum(r["domain"] == oracle_domains[r["category"]] for r in agree)
                                          / len(agree)) if agree else None),
        "oracle_domains": oracle_domains,
        "hf_generate_tokens_per_s": round_or_none(hf_tps, 3),
        "hf_generate_prompts": len(hf_records),
        "hf_generate_matches_ar": f"{hf_agree}/{len(hf_records)}",
        "ar_vs_hf_generate": (round_or_none(aggregate(hf_strategy_records[BASELINE])["tokens_per_s"] / hf_tps)
                              if hf_tps else None),
        "ar_bandwidth_gb_s": round_or_none(backbone.weight_bytes() * ar_tps / 1e9, 2),
        "weight_bytes_per_step": backbone.weight_bytes(),
        "truncated_prompts": len(truncated),
        "truncated_question_ids": truncated,
        "order": [q.question_id for q in order],
        "order_switch_rate": round_or_none(switch_rate(order)),
        "definitions": DEFINITIONS,
    }


# --- output -------------------------------------------------------------------------------------
def write_outputs(run: BenchRun, out_dir) -> dict:
    """`<strategy>.jsonl` and summary.json (data only; `python -m viz.bench_figures` draws them)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, lines in run.answers.items():
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for a in lines:
                f.write(json.dumps(a, ensure_ascii=False) + "\n")
    report = {"answers": [str(out / f"{n}.jsonl") for n in run.answers]}
    run.summary["outputs"] = report
    (out / "summary.json").write_text(json.dumps(run.summary, indent=1, ensure_ascii=False), encoding="utf-8")
    return report


def plain_table(summary: dict) -> str:
    """The run in one markdown table (the CLI's print; viz.bench_figures has the full report)."""
    rows = ["| strategy | tokens/s | speedup | τ | α |", "|---|---|---|---|---|"]
    for n, s in summary["strategies"].items():
        rows.append(f"| {n} | {s['tokens_per_s']:.1f} | {s['speedup']:.3f} | {s['tau']:.2f} | {s['alpha']:.2f} |")
    return "\n".join(rows)


def main(argv=None, backbone: Backbone | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", default=None, help="Spec-Bench question file (.jsonl); required without --batch")
    ap.add_argument("--strategies", default=None, help=f"comma-separated, from {','.join(STRATEGIES)} ({BASELINE} is "
                    f"always run first; default {','.join((BASELINE, *SPECULATIVE))}; with --batch: knn)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="truncate longer prompts (head + tail kept); the summary counts them")
    ap.add_argument("--limit", type=int, default=None, help="at most N questions per category (file order)")
    ap.add_argument("--categories", default=None, help="comma-separated categories to keep")
    ap.add_argument("--mix-ratio", type=float, default=0.0,
                    help="0 = category blocks, 1 = switch category after every prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gamma", type=int, default=None, help="draft length (default: the calibration's)")
    ap.add_argument("--hf-generate-every", type=int, default=1,
                    help="time model.generate right after ar on every K-th prompt (0 = never)")
    ap.add_argument("--model", default=None, help="model spec (default: embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--calibration", default=None, help="calibration folder (default: assets/calibration/<slug>)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--draft", default="int8", choices=DRAFT_KINDS,
                    help="draft weights: int8 (quantised copy, the default) or fp32 (layer skipping only)")
    ap.add_argument("--no-lookup", action="store_true", help="no prompt-lookup drafts")
    ap.add_argument("--fixed-gamma", action="store_true",
                    help="always draft --gamma tokens (default: the latency model picks ≤ gamma per step)")
    ap.add_argument("--no-figures", action="store_true",
                    help="do not print the command that renders the tables and figures")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--traces", default=None, metavar="DIR",
                    help="also write every run as a trace the app can replay: DIR/<strategy>/<question_id>.json")
    ap.add_argument("--out", default=None, help="output folder (required without --batch)")
    batch_bench.add_arguments(ap)
    add_device_argument(ap)
    args = ap.parse_args(argv)
    if args.batch is None and not (args.questions and args.out):
        ap.error("the following arguments are required: --questions, --out (or --batch N)")

    torch.set_num_threads(args.threads)
    if args.batch is not None:         # N concurrent streams through the serving engine (tools.batch_bench)
        return batch_bench.main(args, sys.argv[1:] if argv is None else list(argv), backbone)
    names = parse_strategies(args.strategies or ",".join((BASELINE, *SPECULATIVE)))
    try:
        questions = select(load_questions(args.questions),
                           args.categories.split(",") if args.categories else None, args.limit)
    except (OSError, ValueError) as exc:     # what is wrong in one sentence, like a missing calibration below
        raise SystemExit(f"Cannot read the questions ({exc}): pass --questions a Spec-Bench question file.") from None
    folder = Path(args.calibration) if args.calibration else cal_io.default_folder(args.model)
    if not (folder / "calibration.json").is_file():          # before the model loads: say it at once
        raise SystemExit(f"No calibration at {folder}: pass --calibration a folder python -m ssd_core.calibrate wrote, "
                         f"or build one: python -m ssd_core.calibrate{f' --model {args.model}' if args.model else ''} "
                         f"--out {folder}")
    try:
        bb = backbone or load_backbone(args.model, threads=args.threads, device=args.device)
        cal = cal_io.load(folder, bb)
    except (ModelNotFoundError, cal_io.CalibrationError) as exc:
        raise SystemExit(str(exc)) from None
    # KnapSpec, adaptive γ and auto plan with this machine's costs: cached, committed, or measured now
    cal.latency, source = profiles.for_machine(bb, cal, folder, progress=not args.no_progress)
    settings = {"questions": args.questions, "limit": args.limit, "categories": args.categories,
                "model": args.model, "calibration": str(folder), "threads": args.threads,
                "out": args.out, "latency_profiled_on": cal.latency.device_words, "latency_source": source}
    run = run_bench(bb, cal, questions, names, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                    max_prompt_tokens=args.max_prompt_tokens, mix_ratio=args.mix_ratio, seed=args.seed,
                    hf_generate_every=args.hf_generate_every, warmup=not args.no_warmup,
                    progress=not args.no_progress, settings=settings, draft=args.draft,
                    lookup=not args.no_lookup, adaptive=not args.fixed_gamma, traces=args.traces)
    write_outputs(run, args.out)
    print(plain_table(run.summary))
    print(f"\nwrote {args.out}/summary.json and {len(run.answers)} answer files")
    if not args.no_figures:
        print(f"tables and figures: python -m viz.bench_figures {args.out}")
    if not run.lossless:
        for f in run.summary["lossless_failures"]:
            ref = "transformers' model.generate" if f["reference"] == "hf_generate" else "ar"
            print(f"LOSSLESS FAILURE: strategy {f['strategy']} on question {f['question_id']} "
                  f"({f['category']}) differs from {ref} at token {f['first_difference_at_token']}",
                  file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
