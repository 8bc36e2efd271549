"""`python -m ssd_core.bench --batch N`: N concurrent streams through the serving engine, timed like
llama.cpp's `llama-batched-bench -npp P -ntg G -npl N` (its S_TG = N·G / t_TG), so the two compare.

    python -m ssd_core.bench --batch 1,4,8,16 --repeats 3 --strategies ar,knn --out batch.json

What is timed, and why it matches llama-batched-bench:
- N prompts of exactly P tokens (`--prompt-tokens`: the project's own held-out domain prompts, one domain
  per stream in turn, cut or repeated to P tokens inside the chat template) arrive together: the engine
  admits nobody until all N are queued, then prefills them in one packed pass (prefill chunk N·P), as
  llama-batched-bench prefills every sequence in one batch before it generates.
- prefill_s: from releasing the N requests to the moment the last stream got its Start (the event the
  prefill ends with; its token comes from the prefill's own logits).
- Each stream then commits exactly G tokens after its Start (`--gen-tokens`; max_new_tokens G + 1, EOS
  ignored), as llama's G passes after the prefill add G tokens per sequence. The Start's token is not
  counted, as llama does not count the token its prefill's logits give.
- gen_s: from the last Start to the moment the last stream had its G tokens; gen_tokens_per_s =
  N·G / gen_s (S_TG); total_s = prefill_s + gen_s (llama's T).
Times are read where each stream's reader thread receives its events; the engine runs ahead of its
readers, so the only error is a thread's wake-up, against steps of tens of milliseconds.

Every N (and strategy) runs in one process, in interleaved order across `--repeats` (odd repeats walk
the sizes backwards), after an untimed warm-up, so machine drift hits all sizes alike. With `ar` in the
run, every other run's greedy tokens must equal `ar`'s at the same N (exit status 1 if not).
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..calibration import artifact as cal_io
from ..calibration import profiles
from ..calibration.domains import DOMAINS, load_prompts, split
from ..engine.decode import DecodeConfig, Start, Step, decode
from ..engine.device import device_label
from ..engine.goodput import GoodputRule, costs_for_machine
from ..engine.loading import ModelNotFoundError, load_backbone
from ..engine.machine import cpu_info
from ..engine.prompt import PromptIds
from ..engine.rows import Row
from ..engine.serve import Engine
from ..policies.registry import BASELINE, STRATEGIES, build as build_strategy
from .metrics import machine

DEFINITIONS = {
    "prefill_s": "release of all N requests (arrived together) → the last stream's Start; one packed prefill pass",
    "gen_s": "the last stream's Start → the last stream's G-th token after its Start",
    "gen_tokens_per_s": "N·G / gen_s: tokens committed after each Start, as llama-batched-bench's S_TG",
    "total_s": "prefill_s + gen_s (llama-batched-bench's T)",
    "gamma_choices": "the goodput rule's draft-length cap → engine steps it chose it (steps several rows "
                     "decoded in; a lone stream drafts its own adaptive length, and the rule is not asked)",
    "drafted_lengths": "tokens drafted → row steps that drafted that many (what was drafted under the caps)",
    "tau": "tokens committed per row step after the Start", "alpha": "accepted drafts / drafted",
    "matches_ar": "greedy tokens equal to the ar run's at the same N (null: no ar run at that N yet)",
}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The batch flags of `python -m ssd_core.bench` (it reuses --strategies, --gamma, --draft, --out, …)."""
    g = ap.add_argument_group("batched serving (--batch; --questions is not used)")
    g.add_argument("--batch", type=_sizes, default=None, metavar="N[,N...]",
                   help="N concurrent streams through the serving engine, timed like llama-batched-bench; "
                        "a comma list runs several sizes in one process (default strategy: knn with the "
                        "goodput rule; --strategies ar: plain batched decoding; --out: a .json file or a folder)")
    g.add_argument("--prompt-tokens", type=int, default=128, help="tokens per prompt (exactly)")
    g.add_argument("--gen-tokens", type=int, default=96, help="tokens each stream generates after its Start")
    g.add_argument("--repeats", type=int, default=1, help="runs of every size, interleaved")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected stream counts ≥ 1 like 16 or 1,4,8,16, not {text!r}")
    return list(dict.fromkeys(sizes))


# --- prompts ---------------------------------------------------------------------------------------------
def fit_prompt(bb, text: str, tokens: int) -> PromptIds:
    """`text` in the chat template, its own tokens cut or repeated so the whole is exactly `tokens` long."""
    whole = bb.encode(text)
    a, b = whole.user_span
    head, user, tail = whole.ids[:a], whole.ids[a:b], whole.ids[b:]
    room = tokens - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"{tokens} prompt tokens leave no room inside the chat template "
                         f"({len(head) + len(tail)} tokens)")
    body = (user * (room // len(user) + 1))[:room]
    return PromptIds(head + body + tail, (len(head), len(head) + room), bb.decode(body), truncated=room < len(user))


def batch_prompts(bb, n: int, tokens: int) -> list[tuple[str, PromptIds]]:
    """(domain, prompt) for n streams: held-out domain prompts, the domains in turn."""
    held = {d: split(ps)[1] for d, ps in load_prompts().items()}
    out = []
    for i in range(n):
        d = DOMAINS[i % len(DOMAINS)]
        out.append((d, fit_prompt(bb, held[d][(i // len(DOMAINS)) % len(held[d])], tokens)))
    return out


# --- one timed run ---------------------------------------------------------------------------------------
class _Gated(Engine):
    """The serving engine, admitting nobody until `open()`: then all N streams share the first (prefill) step."""

    released = False

    def _admit(self) -> None:
        if self.released:
            super()._admit()

    def open(self) -> None:
        with self._cv:
            self.released = True
            self._cv.notify_all()


class _Counted:
    """The goodput rule, counting the draft-length cap it chose per shared step."""

    def __init__(self, rule: GoodputRule):
        self.rule, self.choices = rule, Counter()

    def choose(self, rows, gammas, lookups):
        g, words = self.rule.choose(rows, gammas, lookups)
        self.choices[g] += 1
        return g, words


@dataclass
class _Stream:
    domain: str
    prompt: PromptIds
    start: float | None = None           # when its reader got the Start
    done: float | None = None            # when its reader got the last Step
    tokens: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    error: BaseException | None = None


def _consume(bb, s: _Stream, strategy, cfg: DecodeConfig) -> None:
    try:
        for ev in decode(bb, s.prompt, strategy, cfg):
            now = time.perf_counter()
            if isinstance(ev, Start):
                s.start = now
                s.tokens.append(ev.first_token)
            elif isinstance(ev, Step):
                s.steps.append(ev)
                s.tokens.extend(ev.committed)
                s.done = now
    except BaseException as exc:        # noqa: BLE001 - reported by run_batch on the main thread
        s.error = exc


def run_batch(bb, prompts, make_strategy, cfg: DecodeConfig, rule: GoodputRule | None = None) -> dict:
    """N = len(prompts) streams through a fresh engine, released together; their events and times."""
    n, gen = len(prompts), cfg.max_new_tokens - 1
    streams = [_Stream(d, p) for d, p in prompts]
    kv_mb = n * Row(bb, streams[0].prompt, None, cfg).kv_bytes() / 1e6
    counted = _Counted(rule) if rule is not None else None
    engine = _Gated(bb, max_rows=max(n, 16), kv_budget_mb=max(1024.0, 1.1 * kv_mb), rule=counted,
                    chunk=sum(len(p) for _, p in prompts)).attach(thread=False)
    # the engine serves on this thread (the one that loaded the model, as the app does: engine.serve's
    # attach), the streams are read on threads of their own; a watcher releases them together, then
    # closes the engine once every stream is read
    threads = [threading.Thread(target=_consume, args=(bb, s, make_strategy(s.domain), cfg), daemon=True)
               for s in streams]
    clock = {}

    def watch():
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while engine.status()["waiting"] < n:      # every request queued before any is admitted
                if any(s.error for s in streams) or time.monotonic() > deadline:
                    break
                time.sleep(0.001)
            clock["t0"] = time.perf_counter()
            engine.open()
            for t in threads:
                t.join()
        finally:
            engine.close()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    engine.run()
    watcher.join()
    t0, decode_steps = clock.get("t0", time.perf_counter()), engine.steps - 1
    for s in streams:
        if s.error is not None:
            raise RuntimeError(f"a {s.domain} stream failed: {s.error!r}") from s.error
    got = [sum(len(st.committed) for st in s.steps) for s in streams]
    if got != [gen] * n:
        raise RuntimeError(f"streams committed {got} tokens after their Start, expected {gen} each")
    last_start, end = max(s.start for s in streams), max(s.done for s in streams)
    steps = [st for s in streams for st in s.steps]
    drafted = sum(len(st.drafted) for st in steps)
    return {
        "prefill_s": last_start - t0, "gen_s": end - last_start, "total_s": end - t0, "tokens_counted": sum(got),
        "decode_steps": decode_steps, "tau": sum(got) / len(steps),
        "alpha": sum(st.accepted for st in steps) / drafted if drafted else 0.0,
        "mean_rows_per_step": float(statistics.mean(st.rows for st in steps)),
        "gamma_choices": {str(g): c for g, c in sorted(counted.choices.items())} if counted else {},
        "drafted_lengths": {str(k): c for k, c in sorted(Counter(len(st.drafted) for st in steps).items())},
        "streams": [{"domain": s.domain, "start_s": round(s.start - t0, 4), "done_s": round(s.done - t0, 4),
                     "steps": len(s.steps), "drafted": sum(len(st.drafted) for st in s.steps),
                     "accepted": sum(st.accepted for st in s.steps)} for s in streams],
        "token_ids": [tuple(s.tokens) for s in streams],
    }


# --- the benchmark ---------------------------------------------------------------------------------------
def run_sizes(bb, cal, names, sizes, prompt_tokens: int = 128, gen_tokens: int = 96, repeats: int = 1,
              gamma: int = 4, seed: int = 0, draft: str = "int8", lookup: bool = True, adaptive: bool = True,
              warmup: bool = True, progress: bool = True, emit=print) -> list[dict]:
    """Every (repeat, N, strategy) run, interleaved; `emit` gets each run's JSON line as it ends."""
    cfg = DecodeConfig(max_new_tokens=gen_tokens + 1, gamma=gamma, seed=seed, draft=draft, lookup=lookup,
                       stop_at_eos=False)
    need = prompt_tokens + cfg.max_new_tokens + gamma + 2
    if need > bb.max_positions:
        raise ValueError(f"{need} positions exceed the model's {bb.max_positions}; fewer prompt or gen tokens")
    prompts = batch_prompts(bb, max(sizes), prompt_tokens)
    rule = GoodputRule(bb, costs_for_machine(bb)) if any(n != BASELINE for n in names) else None

    def make(name):
        return lambda domain: build_strategy(cal, name, gamma=gamma, category=domain if name == "oracle" else None,
                                             draft=draft, adaptive=adaptive)
    if warmup:                         # the largest batch, every strategy, a few tokens: not recorded
        for name in names:
            run_batch(bb, prompts, make(name), replace(cfg, max_new_tokens=min(9, cfg.max_new_tokens)),
                      None if name == BASELINE else rule)
    order = [(r, n, name) for r in range(repeats) for n in (sizes if r % 2 == 0 else sizes[::-1]) for name in names]
    reference, runs = {}, []
    cpu = cpu_info()
    bar = tqdm(total=len(order), desc="batch bench", unit="run", disable=not progress)
    for r, n, name in order:
        bar.set_postfix_str(f"{name} N={n}")
        res = run_batch(bb, prompts[:n], make(name), cfg, None if name == BASELINE else rule)
        ids = res.pop("token_ids")
        ref = reference.get(n)
        if name == BASELINE and ref is None:
            reference[n] = ids
        run = {"sequences": n, "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens, "strategy": name,
               "gen_tokens_per_s": round(res["tokens_counted"] / res["gen_s"], 2),
               "prefill_s": round(res["prefill_s"], 4), "gen_s": round(res["gen_s"], 4),
               "total_s": round(res["total_s"], 4),
               "prefill_tokens_per_s": round(n * prompt_tokens / res["prefill_s"], 1),
               "tokens_counted": res["tokens_counted"], "decode_steps": res["decode_steps"],
               "tau": round(res["tau"], 3), "alpha": round(res["alpha"], 3),
               "mean_rows_per_step": round(res["mean_rows_per_step"], 2),
               "gamma_choices": res["gamma_choices"], "drafted_lengths": res["drafted_lengths"],
               "matches_ar": None if ref is None else ids == ref,
               "threads": torch.get_num_threads(), "cpu": cpu["model"], "repeat": r}
        emit(json.dumps(run, ensure_ascii=False))
        runs.append({**run, "streams": res["streams"]})
        bar.update()
    bar.close()
    return runs


def medians(runs: list[dict]) -> list[dict]:
    """Per (strategy, N): the median over repeats of gen_tokens_per_s, prefill_s and total_s."""
    keys = list(dict.fromkeys((r["strategy"], r["sequences"]) for r in runs))
    out = []
    for name, n in sorted(keys, key=lambda k: (k[1], k[0])):
        rs = [r for r in runs if (r["strategy"], r["sequences"]) == (name, n)]
        out.append({"strategy": name, "sequences": n, "repeats": len(rs),
                    **{k: round(statistics.median(r[k] for r in rs), 4)
                       for k in ("gen_tokens_per_s", "prefill_s", "total_s")}})
    return out


def _strategies(text: str | None) -> list[str]:
    names = [s.strip() for s in (text or "knn").split(",") if s.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    names = list(dict.fromkeys(names))
    return [n for n in names if n == BASELINE] + [n for n in names if n != BASELINE]   # ar first: the reference


def main(args, argv: list[str], backbone=None) -> int:
    """`python -m ssd_core.bench --batch …` after tools.bench parsed the flags."""
    names = _strategies(args.strategies)
    if args.prompt_tokens < 1 or args.gen_tokens < 1 or args.repeats < 1:
        raise SystemExit("--prompt-tokens, --gen-tokens and --repeats must be ≥ 1")
    folder = Path(args.calibration) if args.calibration else cal_io.default_folder(args.model)
    speculative = any(n != BASELINE for n in names)
    if speculative and not (folder / "calibration.json").is_file():
        raise SystemExit(f"No calibration at {folder}: pass --calibration a folder python -m ssd_core.calibrate "
                         f"wrote, or run only --strategies ar")
    try:
        bb = backbone or load_backbone(args.model, threads=args.threads, device=args.device)
        cal = cal_io.load(folder, bb) if speculative else None
    except (ModelNotFoundError, cal_io.CalibrationError) as exc:
        raise SystemExit(str(exc)) from None
    if cal is not None:                # adaptive γ plans with this machine's single-stream costs
        cal.latency, _ = profiles.for_machine(bb, cal, folder, progress=not args.no_progress)
    gamma = int(args.gamma or (cal.meta.get("settings", {}).get("gamma", 4) if cal is not None else 4))
    machine_info = {"cpu": cpu_info(), **machine(), "kernel": bb.kernel}
    try:
        runs = run_sizes(bb, cal, names, args.batch, args.prompt_tokens, args.gen_tokens, args.repeats, gamma,
                         args.seed, args.draft, not args.no_lookup, not args.fixed_gamma, not args.no_warmup,
                         not args.no_progress, emit=tqdm.write)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if args.out:
        out = Path(args.out)
        out = out if out.suffix == ".json" else out / "batch.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        costs = costs_for_machine(bb) if speculative else None
        report = {"runs": runs, "medians": medians(runs), "command": shlex.join(["python", "-m", "ssd_core.bench", *argv]),
                  "model": bb.name, "device": device_label(bb.device), "definitions": DEFINITIONS,
                  "settings": {"strategies": names, "sizes": args.batch, "prompt_tokens": args.prompt_tokens,
                               "gen_tokens": args.gen_tokens, "repeats": args.repeats, "gamma": gamma,
                               "draft": args.draft, "lookup": not args.no_lookup, "adaptive_gamma": not args.fixed_gamma,
                               "warmup": not args.no_warmup, "seed": args.seed, "stop_at_eos": False, "greedy": True,
                               "calibration": str(folder) if speculative else None},
                  "machine": {**machine_info, "load_average_at_end": machine()["load_average_at_start"],
                              "batch_costs": {"measured": costs.measured, "provisional": costs.provisional}
                              if costs is not None else None}}
        out.write_text(json.dumps(report, indent=1, ensure_ascii=False), encoding="utf-8")
        print(f"wrote {out}", file=sys.stderr)
    bad = [r for r in runs if r["matches_ar"] is False]
    for r in bad:
        print(f"LOSSLESS FAILURE: {r['strategy']} at N={r['sequences']} (repeat {r['repeat']}) differs from ar's "
              f"tokens at the same N", file=sys.stderr)
    return 1 if bad else 0
