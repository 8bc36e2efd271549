"""Rebuild every calibration artefact for a model from assets/domains/*.jsonl.

    python -m ssd_core.calibrate --model SPEC --out assets/calibration/<slug>

Steps (each with a progress bar): small draft head → latency profile (fp32 and each draft kind) →
teacher-forcing data →
per-domain + static skip-set search (mode "speed" or KNN-SSD's "matchness" at a fixed skip ratio;
resumable) → held-out matchness matrix → the domain check (a domain set that does not beat the
static set on its own held-out prompts by `--check-margin` is replaced by the static set, loudly) →
acceptance per draft kind → prompt embeddings (three poolings compared) → KNN router + threshold →
routing on assets/routing_check/ (prompts written after the anchors) → KnapSpec κ → UMAP.

    python -m ssd_core.calibrate --rebuild-router --out DIR

re-embeds only the anchors of an existing calibration (with today's prompt embedding) and rebuilds
its router, routing report and UMAP; skip sets, latency model and drafts stay as they are.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import platform
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..engine.backbone import DEFAULT_EMBEDDING, Backbone
from ..engine.device import add_device_argument
from ..engine.draft import DRAFT_KINDS
from ..engine.loading import load_backbone
from ..policies.knapspec import fit_kappa, prompt_similarity
from . import artifact as cal_io
from .candidates import ratio_count
from .channels import COMPENSATION as CHANNEL_COMPENSATION, IMPORTANCE as CHANNEL_IMPORTANCE, \
    TOKENS as CHANNEL_TOKENS, channel_sets
from .domains import DOMAIN_DIR, domains_hash, load_prompts, split
from .draft_calibration import draft_acceptance, head_for_domains, held_out_data
from .latency import fit_report, profile
from .matchness import build_match_data, matchness_per_domain, model_drafted_only
from .router import Router, suggest_threshold
from .search import CALIBRATION_MODES, SEARCH_METHODS, default_method, search_all, static_share
from .search_memo import SearchMemo, fingerprint

ROUTING_CHECK_DIR = DOMAIN_DIR.parent / "routing_check"
MEMO_NAME = ".search_memo.json"

log = logging.getLogger("ssd_core.calibrate")


# the routing report's name for each embedding kind's pooling ("all": the whole-template mean, compared)
POOLING_NAMES = {"last_token": "last", "user_mean": "user"}


def embed_prompts(bb: Backbone, prompts: list[str], max_prompt_tokens: int, desc: str,
                  progress: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the backbone's embedding kind, user-token mean, whole-template mean) from the prefill."""
    used, user, whole = [], [], []
    for p in tqdm(prompts, desc=desc, disable=not progress, leave=False):
        ids = bb.encode(p, max_tokens=max_prompt_tokens)
        pre = bb.prefill(ids, bb.new_cache(len(ids) + 1))
        used.append(pre.embedding.float().cpu().numpy())
        user.append(pre.embedding_user.float().cpu().numpy())
        whole.append(pre.embedding_all.float().cpu().numpy())
    return np.stack(used), np.stack(user), np.stack(whole)


def build_router(bb: Backbone, splits: dict, domain_sets: dict, static_skip, seed: int,
                 max_prompt_tokens: int, progress: bool = True) -> tuple[Router, dict]:
    """The KNN router on the backbone's embedding kind (centred), and the routing report.

    splits: domain → (calibration prompts = anchors, held-out prompts for the threshold and accuracy).
    The report compares the poolings (the backbone's, the user-token mean, the whole-template mean),
    names the one used ("used") and its embedding kind, and adds routing on assets/routing_check/.
    """
    emb = {d: [embed_prompts(bb, part, max_prompt_tokens, f"embed {d}/{which}", progress)
               for which, part in zip(("cal", "held"), s)] for d, s in splits.items()}
    used = POOLING_NAMES[bb.embedding_kind]
    routing, routers = {}, {}
    for col, pooling in enumerate((used, "user", "all")):
        if pooling in routers:
            continue
        r = Router.build({d: e[0][col] for d, e in emb.items()}, {d: s[0] for d, s in splits.items()},
                         domain_sets, static_skip, seed=seed, threshold=-1.0, centre=True)
        held = {d: e[1][col] for d, e in emb.items()}
        thr = suggest_threshold(r, held)
        r = r.with_settings(threshold=thr)
        routers[pooling] = r
        routing[pooling] = {"threshold": round(thr, 4),
                            "accuracy": {k: round(v, 4) for k, v in r.accuracy(held).items()},
                            "accuracy_majority": {k: round(v, 4) for k, v in
                                                  r.accuracy(held, vote="majority").items()}}
    # The app and the bench route on the backbone's embedding kind (decode.Start.embedding).
    routing["used"] = used
    routing["embedding"] = bb.embedding_kind
    router = routers[used]
    outside = routing_check(router, bb, max_prompt_tokens, progress=progress)
    if outside is not None:
        routing["check_set"] = outside
    return router, routing


def _kappa_points(bb, results, prompts_by_domain, max_prompt_tokens) -> list[tuple[float, float]]:
    """(loss under the knapsack's measure, searched matchness) for every trial of every search."""
    points = []
    for domain, res in results.items():
        sims = [prompt_similarity(bb, bb.encode(p, max_tokens=max_prompt_tokens).ids)
                for p in prompts_by_domain[domain][:4]]
        attn = np.mean([s[0] for s in sims], axis=0)
        mlp = np.mean([s[1] for s in sims], axis=0)
        for h in res.history:
            loss = sum(1 - attn[i] for i in h["attn"]) + sum(1 - mlp[i] for i in h["mlp"])
            points.append((float(loss), float(h["matchness"])))
    return points


def check_domain_sets(matrix: dict, domain_sets: dict, margin: float) -> dict:
    """Does each domain's set beat the static set on the domain's own held-out prompts by `margin`?

    matrix: set name → domain → held-out matchness (with a "static" row). Returns, per domain, own
    (its set on its prompts), static (the static set on them), other (its set on the other
    domains, mean), gain = own - static and passed.
    """
    out = {}
    for d in domain_sets:
        own, base = matrix[d][d], matrix["static"][d]
        others = [v for k, v in matrix[d].items() if k != d]
        out[d] = {"own": round(own, 4), "static": round(base, 4),
                  "other": round(float(np.mean(others)), 4) if others else None,
                  "gain": round(own - base, 4), "passed": bool(own >= base + margin)}
    return out


def routing_check(router: Router, bb: Backbone, max_prompt_tokens: int, folder: Path = ROUTING_CHECK_DIR,
                  progress: bool = True) -> dict | None:
    """Routing accuracy (and the routes taken) on prompts written after the anchors were fixed."""
    if not all((Path(folder) / f"{d}.jsonl").exists() for d in router.domain_sets):
        return None
    prompts = load_prompts(folder, tuple(router.domain_sets))
    emb = {d: embed_prompts(bb, ps, max_prompt_tokens, f"routing check {d}", progress)[0]
           for d, ps in prompts.items()}
    routed = {d: [router.route(e).domain or "unknown" for e in vecs] for d, vecs in emb.items()}
    return {"accuracy": {k: round(v, 4) for k, v in router.accuracy(emb).items()},
            "routed_to": {d: {k: r.count(k) for k in sorted(set(r))} for d, r in routed.items()},
            "prompts": sum(len(v) for v in prompts.values())}


def predicted_speedups(latency, domain_sets, static, matrix, gamma, drafts=None) -> dict:
    """Each set's predicted speedup at its held-out acceptance (static: mean over domains).

    With draft numbers (draft_calibration.py): also per draft kind, at the best γ ≤ gamma, as
    {kind: {set: speedup}} under "by_draft".
    """
    out = {}
    for name, skip in [*domain_sets.items(), ("static", static)]:
        row = matrix[name]
        acc = float(np.mean(list(row.values()))) if name == "static" else row.get(name, 0.0)
        out[name] = round(latency.expected_speedup(skip, acc, gamma), 4)
    by_draft = {}
    for kind, accs in ((drafts or {}).get("acceptance") or {}).items():
        sets = {**domain_sets, "static": static, "full": type(static).empty()}
        by_draft[kind] = {}
        for name, skip in sets.items():
            acc = accs.get(name, 0.0)
            g = latency.best_gamma(skip, acc, gamma, kind=kind)
            by_draft[kind][name] = round(latency.expected_speedup(skip, acc, g, kind=kind), 4)
    if by_draft:
        out["by_draft"] = by_draft
    return out


def reprofile(folder: Path, model: str | None = None, progress: bool = True,
              device: str | torch.device = "auto") -> cal_io.Calibration:
    """Re-measure only the latency model (e.g. on a quiet machine, or on a GPU) and rewrite the calibration."""
    bb = load_backbone(model, threads=torch.get_num_threads(), device=device)
    cal = cal_io.load(folder, bb)
    t = time.perf_counter()
    prompts = load_prompts()
    head = head_for_domains(bb, prompts, progress=progress)
    data = held_out_data(bb, prompts, max_prompt_tokens=cal.meta["settings"]["max_prompt_tokens"],
                         window=cal.meta["settings"].get("matchness_window"))
    cal.drafts = {"head": head, "acceptance": draft_acceptance(
        bb, {**cal.domain_sets, "static": cal.static}, data, progress=progress)}
    cal.meta["timings"]["drafts_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    cal.latency = profile(bb, progress=progress)
    gamma = cal.meta["settings"]["gamma"]
    cal.meta["timings"]["latency_s"] = round(time.perf_counter() - t, 1)
    cal.meta["latency_fit"] = fit_report(cal.latency)
    cal.meta["machine"]["threads"] = torch.get_num_threads()
    cal.meta["machine"]["device"] = cal.latency.device
    cal.meta["predicted_speedup"] = predicted_speedups(cal.latency, cal.domain_sets, cal.static,
                                                       cal.matchness, gamma, cal.drafts)
    cal.meta.pop("files", None)
    cal_io.save(cal, folder)
    return cal_io.load(folder, bb)


def rebuild_router(folder: Path, model: str | None = None, progress: bool = True,
                   device: str | torch.device = "auto", backbone: Backbone | None = None,
                   umap: bool | None = None) -> cal_io.Calibration:
    """Re-embed an existing calibration's anchors with today's embedding (DEFAULT_EMBEDDING) and
    rebuild its router, routing report and (if it had one, or `umap`) its UMAP; the rest stays.

    The anchors are the calibration split of the domain files it was made from (load checks their
    hash), so the skip sets stay valid."""
    folder = Path(folder)
    bb = backbone or load_backbone(model, threads=torch.get_num_threads(), device=device)
    cal = cal_io.load(folder, bb)            # sets the old embedding kind on bb; replaced below
    had_map = "umap.joblib" in cal.meta.get("files", {})
    refit = had_map if umap is None else umap
    if had_map and not refit:                # its map would place new prompts among the old anchors
        raise ValueError(f"{folder} has a domain map fitted on its old anchor vectors; a router rebuild "
                         "refits it too (leave out --no-umap)")
    bb.set_embedding(DEFAULT_EMBEDDING)
    settings = cal.meta["settings"]
    splits = {d: split(ps) for d, ps in load_prompts().items()}
    t = time.perf_counter()
    router, routing = build_router(bb, splits, cal.domain_sets, cal.static, settings["seed"],
                                   settings["max_prompt_tokens"], progress)
    cal.router = router.with_settings(k=cal.router.k, vote=cal.router.vote)
    cal.routing = routing
    cal.meta.setdefault("timings", {})["router_s"] = round(time.perf_counter() - t, 1)
    cal.meta["embedding"] = bb.embedding_kind
    domain_map = None
    if refit:
        from .domain_map import DomainMap
        t = time.perf_counter()
        domain_map = DomainMap.fit(router.vectors, seed=settings["seed"])
        cal.meta["timings"]["umap_s"] = round(time.perf_counter() - t, 1)
    cal.meta.pop("files", None)
    cal_io.save(cal, folder, domain_map)
    return cal_io.load(folder, bb)


def calibrate(model: str | None, out: Path, budget: int = 60, gamma: int = 4,
              prompts_per_domain: int = 10, held_out_per_domain: int = 6, continuation_tokens: int = 24,
              max_prompt_tokens: int = 256, domain_dir: Path = DOMAIN_DIR, seed: int = 0,
              backbone: Backbone | None = None, profile_kw: dict | None = None,
              umap: bool = True, progress: bool = True,
              min_skip_ratio: float = 0.03, draft: str = "int8", search_mode: str = "speed",
              skip_ratio: float = 0.25, check_margin: float = 0.02, resume: bool = True,
              device: str | torch.device = "auto", search_method: str | None = None,
              lookup_aware: bool = False, matchness_window: int | None = None,
              channel_keep: float = 0.7, channel_tokens: str = "continuation",
              channel_importance: str = "magnitude", channel_compensation: str = "mean") -> cal_io.Calibration:
    """Build every artefact. min_skip_ratio: least share of the 2·L sublayers a set must skip.
    device: where a model loaded here runs (auto|cpu|cuda; a given `backbone` stays where it is);
    the latency model is profiled there.

    search_mode "speed" maximises predicted speedup above that floor; "matchness" (KNN-SSD) fixes
    every set at `skip_ratio` of the 2·L sublayers and maximises matchness, with TPE or (search_method
    "greedy", the default there) by importance, construction and swaps (calibration.greedy). check_margin: how much
    a domain's set must beat the static set on its own held-out prompts to be kept. resume: reuse
    the matchness memo an interrupted run left in `out` (same model, draft and data only).
    lookup_aware: the search and the domain check score matchness only where prompt lookup would
    not draft (matchness.model_drafted_only); the draft acceptance stays over every position.
    matchness_window: score every matchness (search, check, acceptance) as decoding with drafts of
    that many tokens sees it (matchness module docstring); None: SWIFT's measure.

    search_mode "channels" searches nothing: every domain's set keeps the `channel_keep` share of each
    MLP's channels that matter most on its calibration prompts, the static set those that matter most
    over all domains (channels.py); no whole sublayer is skipped. channel_tokens: the positions a
    channel's importance is measured on ("continuation", the default, or "all"; channels.TOKENS);
    channel_importance: how ("magnitude" or "taylor"; channels.IMPORTANCE). channel_compensation "mean"
    (the default): every cut MLP adds its dropped channels' mean activation output, each ranking's means
    measured on the same prompts (channels.channel_means); "none" drops them.

    A skip set must skip something (else the draft is just the draft weights); with the int8 draft
    on a 2-core CPU every extra skipped sublayer costs more acceptance than it saves time, so the
    default floor is 2 sublayers (3%) and the search maximises predicted tokens per unit time above
    it. With that floor every domain of the default model got the same set (see the README).
    """
    search_method = search_method or default_method(search_mode)
    if channel_compensation not in CHANNEL_COMPENSATION:     # before the long work, not after it
        raise ValueError(f"channel_compensation must be one of {', '.join(CHANNEL_COMPENSATION)}, "
                         f"not {channel_compensation!r}")
    t_start = time.perf_counter()
    timings = {}
    bb = backbone or load_backbone(model, threads=torch.get_num_threads(), device=device)
    bb.set_embedding(DEFAULT_EMBEDDING)    # a backbone that ran an older calibration may pool otherwise
    prompts = load_prompts(domain_dir)
    splits = {d: split(ps) for d, ps in prompts.items()}

    t = time.perf_counter()                # the small draft head first: the profile times the draft with it
    head = head_for_domains(bb, prompts, max_prompt_tokens=max_prompt_tokens, progress=progress)
    timings["draft_head_s"] = time.perf_counter() - t

    t = time.perf_counter()
    latency = profile(bb, progress=progress, **(profile_kw or {}))
    timings["latency_s"] = time.perf_counter() - t

    t = time.perf_counter()
    search_data = {d: build_match_data(bb, s[0][:prompts_per_domain], continuation_tokens, max_prompt_tokens,
                                       progress=progress, window=matchness_window) for d, s in splits.items()}
    held_data = {d: build_match_data(bb, s[1][:held_out_per_domain], continuation_tokens, max_prompt_tokens,
                                     progress=progress, window=matchness_window) for d, s in splits.items()}
    timings["match_data_s"] = time.perf_counter() - t
    scored = model_drafted_only if lookup_aware else (lambda data: data)
    search_scored = {d: scored(x) for d, x in search_data.items()}
    held_scored = {d: scored(x) for d, x in held_data.items()}

    t = time.perf_counter()
    min_skipped = int(np.ceil(min_skip_ratio * 2 * bb.n_layers)) if min_skip_ratio > 0 else 1
    ranks, means, memo = None, None, None
    if search_mode == "channels":
        ranks, means, searched, static_skip = channel_sets(
            bb, search_data, channel_keep, progress=progress, tokens=channel_tokens,
            importance=channel_importance, compensation=channel_compensation)
        bb.set_channel_ranks(ranks, means)
        results, static = {}, None
    else:
        static_per_domain = static_share(prompts_per_domain, len(splits))
        memo = SearchMemo(Path(out) / MEMO_NAME, fingerprint(
            model=bb.name, draft=draft, domains=domains_hash(domain_dir), prompts=prompts_per_domain,
            tokens=continuation_tokens, max_prompt=max_prompt_tokens, static_per_domain=static_per_domain,
            lookup_aware=lookup_aware, window=matchness_window))
        if not resume:
            memo.data = {}
        elif memo.size and progress:
            print(f"resuming the search: {memo.size} matchness values from {memo.path}")
        results, static = search_all(bb, search_scored, latency, budget=budget, gamma=gamma, seed=seed,
                                     progress=progress, min_skipped=min_skipped, draft=bb.draft_weights(draft),
                                     mode=search_mode, skip_ratio=skip_ratio, memo=memo, method=search_method,
                                     static_per_domain=static_per_domain)
        searched = {d: r.skip for d, r in results.items()}
        static_skip = static.skip
    timings["search_s"] = time.perf_counter() - t

    t = time.perf_counter()
    matrix = {}
    for name, skip in tqdm([*searched.items(), ("static", static_skip)], desc="held-out matchness",
                           disable=not progress):
        matrix[name] = {d: round(v, 4) for d, v in matchness_per_domain(
            bb, skip, held_scored, bb.draft_weights(draft)).items()}
    check = check_domain_sets(matrix, searched, check_margin)
    domain_sets = {d: s if check[d]["passed"] else static_skip.with_name(d) for d, s in searched.items()}
    for d, c in check.items():
        if not c["passed"]:
            matrix[d] = dict(matrix["static"])
            log.warning("CHECK FAILED for domain %s: its searched set %s does not beat the static set "
                        "on its own held-out prompts (%.3f vs %.3f, margin %.2f); it routes to the "
                        "static set", d, searched[d], c["own"], c["static"], check_margin)
    drafts = {"head": head, "acceptance": draft_acceptance(bb, {**domain_sets, "static": static_skip},
                                                           held_data, progress=progress)}
    timings["matchness_s"] = time.perf_counter() - t

    t = time.perf_counter()
    router, routing = build_router(bb, splits, domain_sets, static_skip, seed, max_prompt_tokens, progress)
    timings["router_s"] = time.perf_counter() - t

    t = time.perf_counter()
    kappa = fit_kappa(_kappa_points(bb, results, {d: s[0] for d, s in splits.items()}, max_prompt_tokens))
    # (channel mode searches nothing: no points, and fit_kappa keeps its default)
    timings["kappa_s"] = time.perf_counter() - t

    domain_map = None
    if umap:
        from .domain_map import DomainMap
        t = time.perf_counter()
        domain_map = DomainMap.fit(router.vectors, seed=seed)
        timings["umap_s"] = time.perf_counter() - t

    timings["total_s"] = time.perf_counter() - t_start
    meta = {
        "model": bb.name, "n_layers": bb.n_layers, "hidden": bb.hidden, "embedding": bb.embedding_kind,
        "domains": list(prompts), "domains_hash": domains_hash(domain_dir),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"processor": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__, "device": latency.device},
        "settings": {"budget": budget, "gamma": gamma, "prompts_per_domain": prompts_per_domain,
                     "held_out_per_domain": held_out_per_domain,
                     "continuation_tokens": continuation_tokens, "max_prompt_tokens": max_prompt_tokens,
                     "seed": seed, "min_skip_ratio": min_skip_ratio, "min_skipped": min_skipped,
                     "search_draft": draft, "matchness_draft": draft, "search_mode": search_mode,
                     "search_method": search_method,
                     "skip_ratio": skip_ratio if search_mode == "matchness" else None,
                     "skipped_per_set": ratio_count(bb.n_layers, skip_ratio)
                     if search_mode == "matchness" else None, "check_margin": check_margin,
                     "lookup_aware": lookup_aware, "matchness_window": matchness_window,
                     "channel_keep": channel_keep if search_mode == "channels" else None,
                     "channel_tokens": channel_tokens if search_mode == "channels" else None,
                     "channel_importance": channel_importance if search_mode == "channels" else None,
                     "channel_compensation": channel_compensation if search_mode == "channels" else None},
        "check": check,
        "searched_sets": {d: s.to_dict() for d, s in searched.items()},
        "timings": {k: round(v, 1) for k, v in timings.items()},
        "latency_fit": fit_report(latency),
        "search": {name: {"matchness": round(r.matchness, 4), "objective": round(r.objective, 4),
                          "initial_objective": round(r.initial_objective, 4), "trials": r.trials}
                   for name, r in [*results.items(), *([("static", static)] if static else [])]},
        "skip_weight_ratio": {name: round(bb.skip_weight_ratio(s), 4)
                              for name, s in [*domain_sets.items(), ("static", static_skip)]},
        "predicted_speedup": predicted_speedups(latency, domain_sets, static_skip, matrix, gamma, drafts),
    }
    cal = cal_io.Calibration(meta=meta, latency=latency, domain_sets=domain_sets, static=static_skip,
                             router=router, matchness=matrix, routing=routing,
                             knapspec={"kappa": round(kappa, 4)}, folder=Path(out), drafts=drafts,
                             channel_ranks=ranks, channel_means=means)
    history = {name: r.to_dict() for name, r in [*results.items(), *([("static", static)] if static else [])]}
    cal_io.save(cal, out, domain_map, extra_json={"search_history.json": history})
    if memo is not None:
        memo.remove()
    return cal_io.load(out, bb, domain_dir)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF id, local folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--out", default=None, help="output folder (default: assets/calibration/<slug>)")
    ap.add_argument("--budget", type=int, default=60, help="search trials per domain (and for static)")
    ap.add_argument("--gamma", type=int, default=4, help="draft length the search optimises for")
    ap.add_argument("--prompts-per-domain", type=int, default=10)
    ap.add_argument("--held-out-per-domain", type=int, default=6)
    ap.add_argument("--continuation-tokens", type=int, default=24,
                    help="tokens of the full model's answer to each prompt that matchness is scored on "
                         "(and, in channel mode, the rankings and means measured on); the channel artefact "
                         "uses 64, the length the bench answers in: with 32 its sets beat the static set by "
                         "less (README, 'Rankings over the whole answer')")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-skip-ratio", type=float, default=0.03,
                    help="least share of sublayers every searched set skips (0: unconstrained)")
    ap.add_argument("--draft", default="int8", choices=DRAFT_KINDS,
                    help="draft weights the sets are searched for (matchness and costs of that kind)")
    ap.add_argument("--search-mode", default="speed", choices=CALIBRATION_MODES,
                    help="speed: maximise predicted tokens per unit time above --min-skip-ratio; "
                         "matchness: KNN-SSD's search, every set skips exactly --skip-ratio of the "
                         "sublayers and the search maximises matchness; channels: no search, every "
                         "domain's set keeps the --channel-keep share of each MLP's channels that "
                         "matter most on its prompts (the static set: on all domains)")
    ap.add_argument("--channel-keep", type=float, default=0.7,
                    help="share of each MLP's channels a set keeps in --search-mode channels")
    ap.add_argument("--channel-tokens", default="continuation", choices=CHANNEL_TOKENS,
                    help="positions a channel's importance is averaged over in --search-mode channels: "
                         "the continuation (what a draft computes; the default, measured better) or "
                         "all, the prompt included")
    ap.add_argument("--channel-compensation", default="mean", choices=CHANNEL_COMPENSATION,
                    help="in --search-mode channels, mean (the default, measured better): every cut MLP "
                         "adds the mean output of the channels it drops (measured on the same prompts, "
                         "per domain; pooled for the static set); none: drops them")
    ap.add_argument("--channel-importance", default="magnitude", choices=CHANNEL_IMPORTANCE,
                    help="how a channel's importance is measured in --search-mode channels: magnitude, what "
                         "it adds to the residual stream, or taylor, |activation × gradient| of the log-"
                         "probability of the full model's next token (one backward pass per sequence)")
    ap.add_argument("--search-method", default=None, choices=SEARCH_METHODS,
                    help="how --search-mode matchness searches: greedy (default there: each "
                         "sublayer's importance, then build the set step by step and swap; --budget "
                         "caps only the swaps) or tpe (optuna over one score per sublayer); speed mode "
                         "uses tpe")
    ap.add_argument("--skip-ratio", type=float, default=0.25,
                    help="share of the 2·L sublayers every set skips in --search-mode matchness")
    ap.add_argument("--check-margin", type=float, default=0.02,
                    help="held-out matchness by which a domain set must beat the static set on its "
                         "own domain; a set that does not routes to the static set")
    ap.add_argument("--lookup-aware", action="store_true",
                    help="score matchness (search and domain check) only at positions where prompt "
                         "lookup would not draft, i.e. where the skip set drafts when lookup is on")
    ap.add_argument("--matchness-window", type=int, default=None, metavar="W",
                    help="score matchness as decoding with drafts of W tokens sees it: each drafted "
                         "token reads the full model's keys / values of the verified text and its own "
                         "for at most W positions (default: its own over the whole continuation)")
    ap.add_argument("--fresh", action="store_true",
                    help="ignore the matchness memo an interrupted run left in --out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reprofile", action="store_true",
                    help="only re-measure the latency model and the draft calibration (small head, "
                         "acceptance per draft kind) of an existing calibration")
    ap.add_argument("--rebuild-router", action="store_true",
                    help="only re-embed the anchors of an existing calibration with the current prompt "
                         "embedding and rebuild its router, routing report and UMAP (docs/routing.md)")
    ap.add_argument("--no-umap", action="store_true", help="skip the UMAP fit (no domain map in the app)")
    add_device_argument(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else cal_io.default_folder(args.model)
    if args.rebuild_router:
        cal = rebuild_router(out, args.model, device=args.device, umap=False if args.no_umap else None)
        print(json.dumps({"out": str(out), "embedding": cal.embedding, "routing": cal.routing}, indent=1))
        return
    if args.reprofile:
        cal = reprofile(out, args.model, device=args.device)
        print(json.dumps({"out": str(out), "latency_fit": cal.meta["latency_fit"],
                          "predicted_speedup": cal.meta["predicted_speedup"]}, indent=1))
        return
    cal = calibrate(args.model, out, budget=args.budget, gamma=args.gamma,
                    prompts_per_domain=args.prompts_per_domain, held_out_per_domain=args.held_out_per_domain,
                    continuation_tokens=args.continuation_tokens, max_prompt_tokens=args.max_prompt_tokens,
                    seed=args.seed, umap=not args.no_umap, min_skip_ratio=args.min_skip_ratio,
                    draft=args.draft, search_mode=args.search_mode, skip_ratio=args.skip_ratio,
                    search_method=args.search_method,
                    check_margin=args.check_margin, resume=not args.fresh, device=args.device,
                    lookup_aware=args.lookup_aware, matchness_window=args.matchness_window,
                    channel_keep=args.channel_keep, channel_tokens=args.channel_tokens,
                    channel_importance=args.channel_importance,
                    channel_compensation=args.channel_compensation)
    print(json.dumps({"out": str(out), "timings": cal.meta["timings"], "routing": cal.routing,
                      "search": cal.meta["search"], "check": cal.meta["check"],
                      "matchness": cal.matchness}, indent=1))


if __name__ == "__main__":
    main()
