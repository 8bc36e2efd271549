"""Spec-Bench-compatible benchmark: τ, α and speedup per category for every strategy, one process.

    python -m ssd_core.bench --questions assets/bench/sample_questions.jsonl \
        --strategies ar,static,knn,oracle,knapspec --max-new-tokens 64 --out assets/bench/sample_run

Input: Spec-Bench's question format (one JSON object a line: question_id, category, turns; the
first turn is the prompt). Output, in --out: `<strategy>.jsonl` in Spec-Bench's answer format,
`summary.json`, `results.md` and plotly figures (HTML; PNG too when kaleido is installed).

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
import platform
import random
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .backbone import Backbone
from .calibration import STRATEGIES, default_folder
from .decode import DecodeConfig
from .draft import DRAFT_KINDS
from .generate import generate
from .latency import expected_tokens
from .strategies import ORACLE_CATEGORY_DOMAIN

DEFINITIONS = {
    "tokens_per_s": "total new tokens ÷ total wall time over the prompts of a group (prefill, routing "
                    "and every step included; the first token comes from the prefill)",
    "decode_tokens_per_s": "tokens committed by verification steps ÷ (wall time − prefill time): "
                           "the decode phase only",
    "speedup": "tokens_per_s of the strategy ÷ tokens_per_s of ar over the same prompts in the same "
               "run (both sums over the same prompts: total new tokens ÷ total wall time)",
    "decode_speedup": "decode_tokens_per_s of the strategy ÷ that of ar, same prompts",
    "speedup_median": "median over prompts of the per-prompt ratio (tokens ÷ wall of the strategy) ÷ "
                      "(tokens ÷ wall of ar): a companion to speedup that a burst of load from other "
                      "processes during one prompt cannot move much",
    "speedup_vs_hf_generate": "tokens_per_s of the strategy ÷ tokens_per_s of transformers' "
                              "model.generate (greedy), both over the prompts where model.generate ran",
    "tau": "mean accepted tokens: tokens committed per verification step, bonus token included, "
           "pooled over every step of every prompt in the group (ar = 1.0); the prefill's token "
           "is not a step",
    "alpha": "acceptance rate: accepted draft tokens ÷ drafted tokens, pooled over the group "
             "(0 when nothing was drafted)",
    "tau_iid_from_alpha": "(1 − α^(γ+1)) / (1 − α): the τ an i.i.d. acceptance α would give",
    "predicted_speedup_measured_alpha": "the calibration's latency model applied to the steps that "
                                        "happened: Σ tokens ÷ Σ step costs, a step costing (model drafts)·"
                                        "c(skip, context, draft kind) + v(drafted + 1) full steps (lookup "
                                        "drafts cost no forward); per prompt, combined over a group as "
                                        "Σ tokens ÷ Σ (tokens ÷ prediction), like tokens_per_s. Against "
                                        "the measured speedup it tests the cost model alone",
    "predicted_speedup_calibration_alpha": "expected_speedup(skip, α, γ*, context, draft kind) with the "
                                           "acceptance the calibration expects for the set used most "
                                           "(held-out matchness on its own domain with this draft kind; "
                                           "static: mean over domains; knapspec: its own estimate) and the "
                                           "best γ* ≤ γ for it: what was expected before the run",
    "lookup_steps": "verification steps whose drafts came from prompt lookup (copied from earlier text)",
    "lookup_accepted": "tokens accepted from prompt-lookup drafts",
    "ar_bandwidth_gb_s": "bytes of weights one full decode step reads (backbone.weight_bytes(), "
                         "lm_head included, KV cache not) × ar tokens_per_s ÷ 1e9",
    "lossless": "every strategy's greedy token ids and text identical to ar's on every prompt, and ar's "
                "token ids identical to transformers' greedy model.generate on every prompt where it ran "
                "(both cut after the first end-of-sequence token)",
    "lossless_vs_ar": "every strategy's greedy token ids and text identical to ar's on every prompt",
    "lossless_vs_hf": "ar's token ids identical to greedy model.generate's on every prompt where it ran "
                      "(null when it never ran): an independent check of the core's forward",
    "routing": "per category, how many prompts the KNN router sent to each domain ('unknown' = "
               "below the router's similarity threshold → static set)",
    "mix_ratio": "order of the stream: 0 = contiguous category blocks (file order); 1 = the category "
                 "changes after every prompt (round-robin); between: at each position the stream "
                 "switches to the next category (cyclic order) with probability R (seeded)",
}


# --- questions and their order --------------------------------------------------------------------
@dataclass(frozen=True)
class Question:
    question_id: object
    category: str
    prompt: str


def load_questions(path) -> list[Question]:
    """Read a Spec-Bench question file; the first turn is the prompt."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            out.append(Question(q["question_id"], str(q["category"]), str(q["turns"][0])))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: expected a Spec-Bench question with question_id, category "
                             f"and turns ({exc})") from exc
    if not out:
        raise ValueError(f"{path} holds no questions")
    return out


def select(questions: list[Question], categories=None, limit: int | None = None) -> list[Question]:
    """Keep the given categories (all if None) and at most `limit` questions per category."""
    if categories:
        wanted = set(categories)
        missing = wanted - {q.category for q in questions}
        if missing:
            raise ValueError(f"no questions in categories {sorted(missing)}")
        questions = [q for q in questions if q.category in wanted]
    if limit is not None:
        seen: Counter = Counter()
        kept = []
        for q in questions:
            if seen[q.category] < limit:
                kept.append(q)
                seen[q.category] += 1
        questions = kept
    return questions


def mix_order(questions: list, ratio: float, seed: int = 0) -> list:
    """Order a question stream like KNN-SSD's task-stream experiment (see DEFINITIONS['mix_ratio'])."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"mix ratio must be in [0, 1], got {ratio}")
    cats = list(dict.fromkeys(q.category for q in questions))
    queues = {c: deque(q for q in questions if q.category == c) for c in cats}
    rng = random.Random(seed)
    out: list = []
    current = cats[0] if cats else None
    while len(out) < len(questions):
        if out:
            at = cats.index(current)
            others = [c for c in cats[at + 1:] + cats[:at] if queues[c]]
            coin = rng.random() < ratio          # drawn every position, so the order is reproducible
            if others and (coin or not queues[current]):
                current = others[0]
        out.append(queues[current].popleft())
    return out


def switch_rate(order: list) -> float:
    """Share of consecutive pairs whose category differs (the realised mix)."""
    if len(order) < 2:
        return 0.0
    return sum(a.category != b.category for a, b in zip(order, order[1:])) / (len(order) - 1)


# --- the arithmetic ---------------------------------------------------------------------------------
def aggregate(records: list[dict]) -> dict:
    """Group figures from per-prompt records {new_tokens, wall_s, prefill_s, accept_lengths, drafted,
    accepted}: tokens/s = Σ tokens ÷ Σ wall, τ pooled over steps, α = Σ accepted ÷ Σ drafted."""
    tokens = sum(r["new_tokens"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    lengths = [n for r in records for n in r["accept_lengths"]]
    decode_wall = sum(r["wall_s"] - r.get("prefill_s", 0.0) for r in records)
    drafted = sum(r.get("drafted", 0) for r in records)
    accepted = sum(r.get("accepted", 0) for r in records)
    return {
        "prompts": len(records), "new_tokens": tokens, "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "decode_tokens_per_s": sum(lengths) / decode_wall if decode_wall > 0 else 0.0,
        "steps": len(lengths),
        "tau": sum(lengths) / len(lengths) if lengths else 1.0,
        "drafted": drafted, "accepted": accepted,
        "alpha": accepted / drafted if drafted else 0.0,
    }


def speedup(records: list[dict], ar_records: list[dict], key: str = "tokens_per_s") -> float | None:
    """Ratio of aggregate tokens/s (or decode tokens/s) over the same prompts."""
    ours, base = aggregate(records)[key], aggregate(ar_records)[key]
    return ours / base if base > 0 else None


def median_speedup(records: list[dict], ar_records: list[dict]) -> float | None:
    """Median of per-prompt tokens/s ratios; records and ar_records are the same prompts in order."""
    ratios = sorted((r["new_tokens"] / r["wall_s"]) / (a["new_tokens"] / a["wall_s"])
                    for r, a in zip(records, ar_records)
                    if r["wall_s"] > 0 and a["wall_s"] > 0 and a["new_tokens"] > 0)
    if not ratios:
        return None
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def combine_predictions(records: list[dict], key: str) -> float | None:
    """Σ tokens ÷ Σ (tokens ÷ predicted speedup): the group's predicted tokens/s ratio."""
    pairs = [(r["new_tokens"], r.get(key)) for r in records]
    if not pairs or any(p is None or p <= 0 for _, p in pairs):
        return None
    total = sum(n for n, _ in pairs)
    return total / sum(n / p for n, p in pairs) if total else None


def _round(x, digits: int = 4):
    return None if x is None else round(float(x), digits)


# --- one run of one strategy on one prompt ------------------------------------------------------------
def predicted_from_steps(latency, steps, kind: str = "fp32") -> float | None:
    """The latency model's speedup for exactly these steps: Σ tokens ÷ Σ step costs in full steps.

    A step costs (model drafts)·c(skip, context, kind) + v(drafted + 1); a lookup draft costs no
    forward, an autoregressive step is v(1) = 1. Compared with the measured speedup it checks the
    cost model alone (the acceptance is the one that happened).
    """
    if not steps:
        return None
    cost = tokens = 0.0
    for s in steps:
        if s.source == "model":      # a kind the profile lacks is priced as fp32 (LatencyModel._costs)
            cost += len(s.drafted) * latency.draft_cost(s.skip, s.context_len, kind)
        cost += latency.verify_cost(len(s.drafted) + 1)
        tokens += len(s.committed)
    return tokens / cost if cost else None


def _record(gen, strategy, question: Question, prompt_ids, calibration, gamma: int,
            kind: str = "fp32") -> dict:
    """Everything the summary and the answer file need from one Generation."""
    st = gen.stats
    spec_steps = [s for s in gen.steps if s.skip is not None]
    skip = None
    if spec_steps:
        skip = Counter(s.skip for s in spec_steps).most_common(1)[0][0]
    ctx = (sum(s.context_len for s in gen.steps) / len(gen.steps)) if gen.steps else len(prompt_ids)
    pred_measured = pred_calib = 1.0
    calib_acc = None
    if skip is not None:
        lat = calibration.latency
        pred_measured = predicted_from_steps(lat, gen.steps, kind)
        calib_acc = calibration.acceptance(kind).get(skip.name)
        if calib_acc is None:          # knapspec: its own exp(−κ·loss) estimate for that set
            for h in getattr(strategy, "history", []):
                if h["skip"]["attn"] == sorted(skip.attn) and h["skip"]["mlp"] == sorted(skip.mlp):
                    calib_acc = h["acceptance"]
        if calib_acc is not None:
            g = lat.best_gamma(skip, calib_acc, gamma, int(ctx), kind)
            pred_calib = lat.expected_speedup(skip, calib_acc, g, int(ctx), kind)
        else:
            pred_calib = None
    info = gen.start.info or {}
    return {
        "question_id": question.question_id, "category": question.category,
        "strategy": strategy.name, "token_ids": gen.token_ids, "text": gen.text,
        "new_tokens": st.new_tokens, "wall_s": st.wall_s, "prefill_s": st.prefill_s,
        "steps": st.steps, "drafted": st.drafted, "accepted": st.accepted,
        "accept_lengths": list(st.accept_lengths), "prompt_tokens": len(prompt_ids),
        "lookup_steps": sum(1 for s in gen.steps if s.source == "lookup"),
        "lookup_accepted": sum(s.accepted for s in gen.steps if s.source == "lookup"),
        "domain": info.get("domain"), "skip": skip.to_dict() if skip is not None else None,
        "context_len": ctx, "calibration_acceptance": calib_acc,
        "predicted_speedup_measured_alpha": pred_measured,
        "predicted_speedup_calibration_alpha": pred_calib,
        "tstamp": time.time(),
    }


def hf_greedy_kwargs(backbone: Backbone, max_new_tokens: int) -> dict:
    """`model.generate` arguments for plain greedy decoding that stops exactly where the core does.

    The core stops after the first token in `backbone.eos_ids` (that token included) or after
    max_new_tokens; generate gets the same stop set. A model's own generation_config may carry
    logits processors (repetition penalty, n-gram bans, a minimum length) that plain greedy
    decoding does not have: they are switched off here so the two are comparable.
    """
    eos = sorted(backbone.eos_ids)
    pad = getattr(backbone.tokenizer, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return {"max_new_tokens": max_new_tokens, "do_sample": False, "num_beams": 1,
            "eos_token_id": eos or None, "pad_token_id": pad, "repetition_penalty": 1.0,
            "no_repeat_ngram_size": 0, "min_new_tokens": 0}


def cut_at_eos(ids, eos_ids) -> tuple:
    """Tokens up to and including the first end-of-sequence token (what the core commits)."""
    ids = tuple(int(t) for t in ids)
    for i, t in enumerate(ids):
        if t in eos_ids:
            return ids[:i + 1]
    return ids


def _hf_generate(backbone: Backbone, prompt_ids, max_new_tokens: int) -> dict:
    """Greedy `model.generate` on the same prompt ids, timed (its new tokens, cut at EOS)."""
    ids = torch.tensor([prompt_ids.ids])
    with torch.inference_mode():
        t = time.perf_counter()
        out = backbone.hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                                         **hf_greedy_kwargs(backbone, max_new_tokens))
        wall = time.perf_counter() - t
    new = cut_at_eos(out[0, ids.shape[1]:].tolist(), backbone.eos_ids)
    return {"new_tokens": len(new), "wall_s": wall, "token_ids": new, "accept_lengths": []}


def _first_difference(a, b) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


# --- the benchmark ---------------------------------------------------------------------------------
@dataclass
class BenchRun:
    summary: dict
    answers: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def lossless(self) -> bool:
        return bool(self.summary["lossless"])


def parse_strategies(text_or_list) -> list[str]:
    names = [s.strip() for s in (text_or_list.split(",") if isinstance(text_or_list, str) else text_or_list)
             if s.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    names = list(dict.fromkeys(names))
    return ["ar"] + [n for n in names if n != "ar"]     # ar first: every ratio needs it


def rss_mb() -> float | None:
    """Resident memory of this process (Linux /proc; None elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def draft_memory(backbone: Backbone, draft: str) -> dict:
    """What the draft copy costs in memory: RSS before / after building it, and its own bytes."""
    before = rss_mb()
    weights = backbone.draft_weights(draft)
    after = rss_mb()
    extra = weights.extra_bytes() if weights is not None else 0
    fp32 = backbone.weight_bytes() + backbone.embed.numel() * backbone.embed.element_size() * (
        backbone.lm_head.data_ptr() != backbone.embed.data_ptr())
    return {"rss_before_draft_mb": before, "rss_after_draft_mb": after,
            "draft_bytes_mb": round(extra / 2 ** 20, 1), "model_bytes_mb": round(fp32 / 2 ** 20, 1),
            "draft_extra_ratio": round(extra / fp32, 4)}


def _machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "load_average_at_start": [round(x, 2) for x in load] if load else None}


def run_bench(backbone: Backbone, calibration, questions: list[Question], strategies=("ar", "static", "knn",
              "oracle", "knapspec"), max_new_tokens: int = 64, gamma: int | None = None,
              max_prompt_tokens: int | None = None, mix_ratio: float = 0.0, seed: int = 0,
              hf_generate_every: int = 1, warmup: bool = True, progress: bool = True,
              settings: dict | None = None, draft: str = "int8", lookup: bool = True,
              adaptive: bool = True) -> BenchRun:
    """Run every strategy on every question, interleaved per prompt; return the summary and answers.

    draft / lookup: the draft's weights and prompt-lookup drafts (DecodeConfig); adaptive: the
    latency model picks each step's draft length ≤ gamma.
    """
    from tqdm.auto import tqdm

    names = parse_strategies(strategies)
    gamma = int(gamma or calibration.meta.get("settings", {}).get("gamma", 4))
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, gamma=gamma, seed=seed, draft=draft, lookup=lookup)
    memory = draft_memory(backbone, draft)
    order = mix_order(list(questions), mix_ratio, seed)
    if not order:
        raise ValueError("no questions to run")
    machine = _machine()
    t_run = time.perf_counter()
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    encoded = {id(q): backbone.encode(q.prompt, max_tokens=max_prompt_tokens) for q in order}
    for q in order:
        need = len(encoded[id(q)]) + max_new_tokens + gamma + 2
        if need > backbone.max_positions:
            raise ValueError(f"question {q.question_id}: {need} positions exceed the model's "
                             f"{backbone.max_positions}; lower --max-prompt-tokens")

    def fresh(name: str, q: Question):
        return calibration.strategy(name, gamma=gamma, category=q.category if name == "oracle" else None,
                                    draft=draft, adaptive=adaptive)

    hf_every = int(hf_generate_every or 0)
    if warmup:                                         # first prompt, every path, not recorded
        q = order[0]
        wcfg = replace(cfg, max_new_tokens=min(16, max_new_tokens))
        for name in names:
            generate(backbone, encoded[id(q)], fresh(name, q), wcfg)
        if hf_every:
            _hf_generate(backbone, encoded[id(q)], min(16, max_new_tokens))

    records: dict[str, list[dict]] = {n: [] for n in names}
    hf_records, hf_strategy_records = [], {n: [] for n in names}
    failures = []
    hf_agree = 0
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
            rec = _record(gen, strat, q, ids, calibration, gamma, draft)
            rec["truncated"] = ids.truncated
            records[name].append(rec)
            if run_hf:
                hf_strategy_records[name].append(rec)
            bar.update()
            if name == "ar":
                ar_rec = rec
                # where the router sends this prompt (same prefill embedding the knn strategy sees)
                rec["domain"] = calibration.router.route(gen.start.embedding).domain
                if run_hf:                             # right after ar, on the same prompt ids
                    bar.set_postfix_str(f"q{q.question_id} {q.category} model.generate")
                    h = _hf_generate(backbone, ids, max_new_tokens)
                    hf_records.append(h)
                    if h["token_ids"] == tuple(rec["token_ids"]):
                        hf_agree += 1
                    else:                              # the core's own reference is off
                        at = _first_difference(rec["token_ids"], h["token_ids"])
                        failures.append({"question_id": q.question_id, "category": q.category,
                                         "strategy": "ar", "reference": "hf_generate",
                                         "first_difference_at_token": at,
                                         "reference_text": backbone.decode(h["token_ids"]),
                                         "text": rec["text"]})
                    bar.update()
            elif rec["token_ids"] != ar_rec["token_ids"] or rec["text"] != ar_rec["text"]:
                at = _first_difference(rec["token_ids"], ar_rec["token_ids"])
                failures.append({"question_id": q.question_id, "category": q.category,
                                 "strategy": name, "reference": "ar", "first_difference_at_token": at,
                                 "reference_text": ar_rec["text"], "ar_text": ar_rec["text"],
                                 "text": rec["text"]})
    bar.close()

    summary = _summarise(backbone, calibration, names, order, records, hf_records, hf_strategy_records,
                         failures, gamma, hf_agree)
    machine["load_average_at_end"] = ([round(x, 2) for x in os.getloadavg()]
                                      if hasattr(os, "getloadavg") else None)
    summary["machine"] = machine
    summary["memory"] = memory
    summary["started"] = started
    summary["total_s"] = round(time.perf_counter() - t_run, 1)
    summary["settings"] = {"strategies": names, "max_new_tokens": max_new_tokens, "gamma": gamma,
                           "max_prompt_tokens": max_prompt_tokens, "mix_ratio": mix_ratio, "seed": seed,
                           "hf_generate_every": hf_every, "warmup": warmup, "stop_at_eos": True,
                           "greedy": True, "draft": draft, "lookup": lookup, "adaptive_gamma": adaptive,
                           "draft_label": (backbone.draft_weights(draft).label
                                           if backbone.draft_weights(draft) is not None else "fp32 draft"),
                           **(settings or {})}
    answers = {n: [_answer(backbone, r) for r in records[n]] for n in names}
    return BenchRun(summary, answers)


def _group_stats(recs: list[dict], ar_recs: list[dict], gamma: int) -> dict:
    agg = aggregate(recs)
    return {
        "tokens_per_s": _round(agg["tokens_per_s"], 3),
        "decode_tokens_per_s": _round(agg["decode_tokens_per_s"], 3),
        "speedup": _round(speedup(recs, ar_recs)),
        "decode_speedup": _round(speedup(recs, ar_recs, "decode_tokens_per_s")),
        "speedup_median": _round(median_speedup(recs, ar_recs)),
        "tau": _round(agg["tau"]), "alpha": _round(agg["alpha"]),
        "tau_iid_from_alpha": _round(expected_tokens(agg["alpha"], gamma)) if agg["drafted"] else 1.0,
        "predicted_speedup_measured_alpha": _round(combine_predictions(recs, "predicted_speedup_measured_alpha")),
        "predicted_speedup_calibration_alpha": _round(combine_predictions(recs, "predicted_speedup_calibration_alpha")),
        "prompts": agg["prompts"], "new_tokens": agg["new_tokens"], "wall_s": _round(agg["wall_s"], 3),
        "steps": agg["steps"], "drafted": agg["drafted"], "accepted": agg["accepted"],
    }


def _summarise(backbone, calibration, names, order, records, hf_records, hf_strategy_records, failures,
               gamma, hf_agree) -> dict:
    cats = list(dict.fromkeys(q.category for q in order))
    ar = records["ar"]
    hf = aggregate(hf_records) if hf_records else None
    hf_tps = hf["tokens_per_s"] if hf else None
    strategies = {}
    for name in names:
        recs = records[name]
        s = _group_stats(recs, ar, gamma)
        if hf_tps:
            sub = aggregate(hf_strategy_records.get(name) or [])
            s["speedup_vs_hf_generate"] = _round(sub["tokens_per_s"] / hf_tps) if sub["prompts"] else None
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
    summary = {
        "model": backbone.name,
        "model_info": backbone.describe(),
        "calibration": str(calibration.folder) if calibration.folder else None,
        "calibration_created": calibration.meta.get("created"),
        "lossless": not failures,
        "lossless_vs_ar": not any(f["reference"] == "ar" for f in failures),
        "lossless_vs_hf": (not any(f["reference"] == "hf_generate" for f in failures)
                           if hf_records else None),
        "lossless_failures": failures,
        "strategies": strategies,
        "categories": cats,
        "routing": routing,
        "routing_source": source,
        "routing_matches_oracle": (_round(sum(r["domain"] == oracle_domains[r["category"]] for r in agree)
                                          / len(agree)) if agree else None),
        "oracle_domains": oracle_domains,
        "hf_generate_tokens_per_s": _round(hf_tps, 3),
        "hf_generate_prompts": len(hf_records),
        "hf_generate_matches_ar": f"{hf_agree}/{len(hf_records)}",
        "ar_vs_hf_generate": (_round(aggregate(hf_strategy_records["ar"])["tokens_per_s"] / hf_tps)
                              if hf_tps else None),
        "ar_bandwidth_gb_s": _round(backbone.weight_bytes() * ar_tps / 1e9, 2),
        "weight_bytes_per_step": backbone.weight_bytes(),
        "truncated_prompts": len(truncated),
        "truncated_question_ids": truncated,
        "order": [q.question_id for q in order],
        "order_switch_rate": _round(switch_rate(order)),
        "definitions": DEFINITIONS,
    }
    return summary


def _answer(backbone, r: dict) -> dict:
    """One Spec-Bench answer line."""
    return {
        "question_id": r["question_id"], "category": r["category"],
        "answer_id": f"{r['strategy']}-{r['question_id']}-{int(r['tstamp'] * 1e6):x}",
        "model_id": f"{backbone.name}-{r['strategy']}",
        "choices": [{"index": 0, "turns": [r["text"]], "new_tokens": [r["new_tokens"]],
                     "wall_time": [round(r["wall_s"], 6)], "accept_lengths": [r["accept_lengths"]],
                     "decoding_steps": [r["steps"]]}],
        "tstamp": r["tstamp"],
    }


# --- output -------------------------------------------------------------------------------------
def write_outputs(run: BenchRun, out_dir, figures: bool = True, png: bool = True) -> dict:
    """`<strategy>.jsonl`, summary.json, results.md and the figures (skipped cleanly without plotly)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, lines in run.answers.items():
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for a in lines:
                f.write(json.dumps(a, ensure_ascii=False) + "\n")
    report = {"answers": [str(out / f"{n}.jsonl") for n in run.answers]}
    table = None
    if figures:
        try:
            from viz import bench_figures as bf
        except ImportError as exc:
            report["figures_skipped"] = f"viz / plotly unavailable: {exc}"
        else:
            (out / "results.md").write_text(bf.markdown_report(run.summary), encoding="utf-8")
            table = bf.overall_table(run.summary) + "\n\n" + bf.category_table(run.summary)
            report["figures"] = bf.save_figures(bf.bench_figures(run.summary, run.answers), out, png=png)
    run.summary["outputs"] = report
    (out / "summary.json").write_text(json.dumps(run.summary, indent=1, ensure_ascii=False), encoding="utf-8")
    return {"table": table, **report}


def plain_table(summary: dict) -> str:
    """A markdown table without plotly (the CLI's fallback print)."""
    rows = ["| strategy | tokens/s | speedup | τ | α |", "|---|---|---|---|---|"]
    for n, s in summary["strategies"].items():
        rows.append(f"| {n} | {s['tokens_per_s']:.1f} | {s['speedup']:.3f} | {s['tau']:.2f} | {s['alpha']:.2f} |")
    return "\n".join(rows)


def main(argv=None, backbone: Backbone | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", required=True, help="Spec-Bench question file (.jsonl)")
    ap.add_argument("--strategies", default="ar,static,knn,oracle,knapspec",
                    help=f"comma-separated, from {','.join(STRATEGIES)} (ar is always run first)")
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
    ap.add_argument("--no-figures", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", required=True, help="output folder")
    args = ap.parse_args(argv)

    from . import calibration as cal_io
    from .backbone import load_backbone

    torch.set_num_threads(args.threads)
    names = parse_strategies(args.strategies)
    questions = select(load_questions(args.questions),
                       args.categories.split(",") if args.categories else None, args.limit)
    bb = backbone or load_backbone(args.model, threads=args.threads)
    folder = Path(args.calibration) if args.calibration else default_folder(args.model)
    cal = cal_io.load(folder, bb)
    settings = {"questions": args.questions, "limit": args.limit, "categories": args.categories,
                "model": args.model, "calibration": str(folder), "threads": args.threads,
                "out": args.out}
    run = run_bench(bb, cal, questions, names, max_new_tokens=args.max_new_tokens, gamma=args.gamma,
                    max_prompt_tokens=args.max_prompt_tokens, mix_ratio=args.mix_ratio, seed=args.seed,
                    hf_generate_every=args.hf_generate_every, warmup=not args.no_warmup,
                    progress=not args.no_progress, settings=settings, draft=args.draft,
                    lookup=not args.no_lookup, adaptive=not args.fixed_gamma)
    written = write_outputs(run, args.out, figures=not args.no_figures)
    print(written["table"] or plain_table(run.summary))
    print(f"\nwrote {args.out}/summary.json and {len(run.answers)} answer files")
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
