"""Rebuild every calibration artefact for a model from assets/domains/*.jsonl.

    python -m ssd_core.calibrate --model SPEC --out assets/calibration/<slug>

Steps (each with a progress bar): small draft head → latency profile (fp32 and each draft kind) →
teacher-forcing data → per-domain + static skip-set search (mode "speed", KNN-SSD's "matchness" at a
fixed skip ratio, or "channels"; resumable) → held-out matchness matrix → the domain check (a domain
set that does not beat the static set on its own held-out prompts by `--check-margin` is replaced by
the static set, loudly) → acceptance per draft kind → prompt embeddings (three poolings compared) → KNN
router + threshold → routing on assets/routing_check/ (prompts written after the anchors) →
KnapSpec κ → UMAP.

    python -m ssd_core.calibrate --rebuild-router --out DIR

re-embeds only the anchors of an existing calibration (with today's prompt embedding) and rebuilds
its router, routing report and UMAP; skip sets, latency model and drafts stay as they are.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ..engine.backbone import EMBEDDING, Backbone
from ..engine.device import add_device_argument
from ..engine.draft import DRAFT_KINDS
from ..engine.loading import ModelNotFoundError, load_backbone
from ..policies.knapspec import fit_kappa
from . import artifact as cal_io
from .candidates import ratio_count
from .channels import channel_sets
from .domains import DOMAIN_DIR, domains_hash, load_prompts, split
from .draft_calibration import draft_acceptance, head_for_domains, held_out_data
from .latency import fit_report, profile
from .matchness import build_match_data, matchness_per_domain, model_drafted_only
from .search import SEARCH_MODES, search_all, static_share
from .search_memo import SearchMemo, fingerprint
from .anchors import build_router, rebuild_router
from .steps import check_domain_sets, embed_prompts, kappa_points, predicted_speedups, routing_check
from .umap_map import DomainMap

# calibrate's modes: the two searches, and "channels" (no search: per-domain MLP channel rankings, channels.py)
CALIBRATION_MODES = (*SEARCH_MODES, "channels")
MEMO_NAME = ".search_memo.json"

log = logging.getLogger("ssd_core.calibrate")

__all__ = ["CALIBRATION_MODES", "CalibrationSettings", "calibrate", "check_domain_sets", "embed_prompts",
           "main", "predicted_speedups", "rebuild_router", "reprofile", "routing_check"]


@dataclass(frozen=True)
class CalibrationSettings:
    """What a calibration measures and searches (the CLI's flags; `main` builds one)."""

    budget: int = 60                    # search trials per domain (and for static)
    gamma: int = 4                      # draft length the search optimises for
    prompts_per_domain: int = 10
    held_out_per_domain: int = 6
    continuation_tokens: int = 24       # tokens of the full model's answer matchness is scored on
    max_prompt_tokens: int = 256
    seed: int = 0
    # least share of the 2·L sublayers a searched set skips: with the int8 draft on a 2-core CPU every
    # extra skipped sublayer costs more acceptance than it saves time, so the floor is 2 sublayers (3%)
    min_skip_ratio: float = 0.03
    draft: str = "int8"                 # draft weights the sets are searched for
    # "speed": maximise predicted tokens per unit time above the floor; "matchness" (KNN-SSD): every
    # set skips exactly `skip_ratio` of the sublayers, greedy search for matchness; "channels": no
    # search, every domain's set keeps the `channel_keep` share of each MLP's channels that matter most
    # on its prompts, the static set those that matter most over all domains (channels.py)
    search_mode: str = "speed"
    skip_ratio: float = 0.25
    channel_keep: float = 0.7
    check_margin: float = 0.02          # how much a domain's set must beat static on its own held-out prompts
    # score matchness (search and domain check) only where prompt lookup would not draft
    # (matchness.model_drafted_only); the draft acceptance stays over every position
    lookup_aware: bool = False
    umap: bool = True                   # fit the domain map (the app's UMAP panel)
    resume: bool = True                 # reuse the matchness memo an interrupted run left in `out`
    domain_dir: Path = DOMAIN_DIR

    def __post_init__(self):            # before the long work, not after it
        if self.search_mode not in CALIBRATION_MODES:
            raise ValueError(f"search_mode must be one of {', '.join(CALIBRATION_MODES)}, not {self.search_mode!r}")
        if self.draft not in DRAFT_KINDS:
            raise ValueError(f"draft must be one of {', '.join(DRAFT_KINDS)}, not {self.draft!r}")
        if not 0.0 < self.channel_keep <= 1.0:
            raise ValueError(f"channel_keep must lie in (0, 1], got {self.channel_keep}")

    def record(self, n_layers: int) -> dict:
        """The settings as calibration.json's meta.settings (the keys older artefacts carry too)."""
        matchness, channels = self.search_mode == "matchness", self.search_mode == "channels"
        return {"budget": self.budget, "gamma": self.gamma, "prompts_per_domain": self.prompts_per_domain,
                "held_out_per_domain": self.held_out_per_domain,
                "continuation_tokens": self.continuation_tokens, "max_prompt_tokens": self.max_prompt_tokens,
                "seed": self.seed, "min_skip_ratio": self.min_skip_ratio, "min_skipped": self.min_skipped(n_layers),
                "search_draft": self.draft, "matchness_draft": self.draft, "search_mode": self.search_mode,
                # the settled choices, recorded as labels (their alternatives were removed: channels.py, search.py)
                "search_method": "greedy" if matchness else "tpe",
                "skip_ratio": self.skip_ratio if matchness else None,
                "skipped_per_set": ratio_count(n_layers, self.skip_ratio) if matchness else None,
                "check_margin": self.check_margin, "lookup_aware": self.lookup_aware,
                "channel_keep": self.channel_keep if channels else None,
                "channel_tokens": "continuation" if channels else None,
                "channel_importance": "magnitude" if channels else None,
                "channel_compensation": "mean" if channels else None}

    def min_skipped(self, n_layers: int) -> int:
        return int(np.ceil(self.min_skip_ratio * 2 * n_layers)) if self.min_skip_ratio > 0 else 1


def reprofile(folder: Path, model: str | None = None, progress: bool = True,
              device: str | torch.device = "auto", latency_only: bool = False) -> cal_io.Calibration:
    """Re-measure the latency model (e.g. on a quiet machine, another CPU, or a GPU) and, unless
    latency_only, the draft calibration (small head, acceptance per draft kind); rewrite the calibration."""
    bb = load_backbone(model, threads=torch.get_num_threads(), device=device)
    cal = cal_io.load(folder, bb)
    if not latency_only:
        t = time.perf_counter()
        prompts = load_prompts()
        head = head_for_domains(bb, prompts, progress=progress)
        data = held_out_data(bb, prompts, max_prompt_tokens=cal.meta["settings"]["max_prompt_tokens"])
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
    cal.meta["machine"]["cpu"] = cal.latency.machine["cpu"]
    cal.meta["predicted_speedup"] = predicted_speedups(cal.latency, cal.domain_sets, cal.static,
                                                       cal.matchness, gamma, cal.drafts)
    cal.meta.pop("files", None)
    cal_io.save(cal, folder)
    return cal_io.load(folder, bb)


def _search(bb, s: CalibrationSettings, out: Path, prompts: dict, search_data: dict, latency, progress: bool):
    """The sets of the settings' mode: (results {domain: SearchResult}, static result or None,
    {domain: SkipSet}, static SkipSet, channel ranks or None, channel means or None, memo or None)."""
    if s.search_mode == "channels":
        ranks, means, searched, static_skip = channel_sets(bb, search_data, s.channel_keep, progress=progress)
        bb.drafts.install_channels(ranks, means)
        return {}, None, searched, static_skip, ranks, means, None
    static_per_domain = static_share(s.prompts_per_domain, len(prompts))
    memo = SearchMemo(Path(out) / MEMO_NAME, fingerprint(
        model=bb.name, draft=s.draft, domains=domains_hash(s.domain_dir), prompts=s.prompts_per_domain,
        tokens=s.continuation_tokens, max_prompt=s.max_prompt_tokens, static_per_domain=static_per_domain,
        lookup_aware=s.lookup_aware))
    if not s.resume:
        memo.data = {}
    elif memo.size and progress:
        print(f"resuming the search: {memo.size} matchness values from {memo.path}")
    scored = {d: model_drafted_only(x) for d, x in search_data.items()} if s.lookup_aware else search_data
    results, static = search_all(bb, scored, latency, budget=s.budget, gamma=s.gamma, seed=s.seed,
                                 progress=progress, min_skipped=s.min_skipped(bb.n_layers),
                                 draft=bb.drafts.get(s.draft), mode=s.search_mode, skip_ratio=s.skip_ratio,
                                 memo=memo, static_per_domain=static_per_domain)
    return results, static, {d: r.skip for d, r in results.items()}, static.skip, None, None, memo


def calibrate(model: str | None, out: Path, settings: CalibrationSettings | None = None, *,
              backbone: Backbone | None = None, device: str | torch.device = "auto", progress: bool = True,
              profile_kw: dict | None = None, **overrides) -> cal_io.Calibration:
    """Build every artefact into `out` and load it back.

    settings: what to measure (CalibrationSettings); overrides: fields replaced in it (e.g.
    `budget=8`). backbone: a loaded model to calibrate (it stays where it is); else `model` is loaded
    on `device` (auto|cpu|cuda) and the latency model is profiled there. profile_kw: latency.profile's
    contexts / verify_ks / repeats (tests shorten it).
    """
    s = dataclasses.replace(settings or CalibrationSettings(), **overrides)
    t_start = time.perf_counter()
    timings = {}
    bb = backbone or load_backbone(model, threads=torch.get_num_threads(), device=device)
    prompts = load_prompts(s.domain_dir)
    splits = {d: split(ps) for d, ps in prompts.items()}

    t = time.perf_counter()                # the small draft head first: the profile times the draft with it
    head = head_for_domains(bb, prompts, max_prompt_tokens=s.max_prompt_tokens, progress=progress)
    timings["draft_head_s"] = time.perf_counter() - t

    t = time.perf_counter()
    latency = profile(bb, progress=progress, **(profile_kw or {}))
    timings["latency_s"] = time.perf_counter() - t

    t = time.perf_counter()
    search_data = {d: build_match_data(bb, p[0][:s.prompts_per_domain], s.continuation_tokens,
                                       s.max_prompt_tokens, progress=progress) for d, p in splits.items()}
    held_data = {d: build_match_data(bb, p[1][:s.held_out_per_domain], s.continuation_tokens,
                                     s.max_prompt_tokens, progress=progress) for d, p in splits.items()}
    timings["match_data_s"] = time.perf_counter() - t

    t = time.perf_counter()
    results, static, searched, static_skip, ranks, means, memo = _search(bb, s, out, prompts, search_data,
                                                                         latency, progress)
    timings["search_s"] = time.perf_counter() - t

    t = time.perf_counter()
    held_scored = {d: model_drafted_only(x) for d, x in held_data.items()} if s.lookup_aware else held_data
    matrix = {}
    for name, skip in tqdm([*searched.items(), ("static", static_skip)], desc="held-out matchness",
                           disable=not progress):
        matrix[name] = {d: round(v, 4) for d, v in matchness_per_domain(
            bb, skip, held_scored, bb.drafts.get(s.draft)).items()}
    check = check_domain_sets(matrix, searched, s.check_margin)
    domain_sets = {d: skip if check[d]["passed"] else static_skip.with_name(d) for d, skip in searched.items()}
    for d, c in check.items():
        if not c["passed"]:
            matrix[d] = dict(matrix["static"])
            log.warning("CHECK FAILED for domain %s: its searched set %s does not beat the static set "
                        "on its own held-out prompts (%.3f vs %.3f, margin %.2f); it routes to the "
                        "static set", d, searched[d], c["own"], c["static"], s.check_margin)
    drafts = {"head": head, "acceptance": draft_acceptance(bb, {**domain_sets, "static": static_skip},
                                                           held_data, progress=progress)}
    timings["matchness_s"] = time.perf_counter() - t

    t = time.perf_counter()
    router, routing = build_router(bb, splits, domain_sets, static_skip, s.seed, s.max_prompt_tokens, progress)
    timings["router_s"] = time.perf_counter() - t

    t = time.perf_counter()
    # (channel mode searches nothing: no points, and fit_kappa keeps its default)
    kappa = fit_kappa(kappa_points(bb, results, {d: p[0] for d, p in splits.items()}, s.max_prompt_tokens))
    timings["kappa_s"] = time.perf_counter() - t

    domain_map = None
    if s.umap:
        t = time.perf_counter()
        domain_map = DomainMap.fit(router.vectors, seed=s.seed)
        timings["umap_s"] = time.perf_counter() - t

    timings["total_s"] = time.perf_counter() - t_start
    searches = [*results.items(), *([("static", static)] if static else [])]
    meta = {
        "model": bb.name, "n_layers": bb.n_layers, "hidden": bb.hidden, "embedding": EMBEDDING,
        "domains": list(prompts), "domains_hash": domains_hash(s.domain_dir),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"processor": platform.processor() or platform.machine(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__, "device": latency.device,
                    "cpu": latency.machine.get("cpu")},
        "settings": s.record(bb.n_layers),
        "check": check,
        "searched_sets": {d: skip.to_dict() for d, skip in searched.items()},
        "timings": {k: round(v, 1) for k, v in timings.items()},
        "latency_fit": fit_report(latency),
        "search": {name: {"matchness": round(r.matchness, 4), "objective": round(r.objective, 4),
                          "initial_objective": round(r.initial_objective, 4), "trials": r.trials}
                   for name, r in searches},
        "skip_weight_ratio": {name: round(bb.skip_weight_ratio(skip), 4)
                              for name, skip in [*domain_sets.items(), ("static", static_skip)]},
        "predicted_speedup": predicted_speedups(latency, domain_sets, static_skip, matrix, s.gamma, drafts),
    }
    cal = cal_io.Calibration(meta=meta, latency=latency, domain_sets=domain_sets, static=static_skip,
                             router=router, matchness=matrix, routing=routing,
                             knapspec={"kappa": round(kappa, 4)}, folder=Path(out), drafts=drafts,
                             channel_ranks=ranks, channel_means=means)
    history = {name: r.to_dict() for name, r in searches}
    cal_io.save(cal, out, domain_map, extra_json={"search_history.json": history})
    if memo is not None:
        memo.remove()
    return cal_io.load(out, bb, s.domain_dir)


def _parser() -> argparse.ArgumentParser:
    d = CalibrationSettings()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF id, local folder or .gguf (default: embedded SmolLM2)")
    ap.add_argument("--out", default=None, help="output folder (default: assets/calibration/<slug>)")
    ap.add_argument("--budget", type=int, default=d.budget, help="search trials per domain (and for static)")
    ap.add_argument("--gamma", type=int, default=d.gamma, help="draft length the search optimises for")
    ap.add_argument("--prompts-per-domain", type=int, default=d.prompts_per_domain)
    ap.add_argument("--held-out-per-domain", type=int, default=d.held_out_per_domain)
    ap.add_argument("--continuation-tokens", type=int, default=d.continuation_tokens,
                    help="tokens of the full model's answer to each prompt that matchness is scored on "
                         "(and, in channel mode, the rankings and means measured on); the channel artefact "
                         "uses 64, the length the bench answers in: with 32 its sets beat the static set by "
                         "less (README, 'Rankings over the whole answer')")
    ap.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--min-skip-ratio", type=float, default=d.min_skip_ratio,
                    help="least share of sublayers every searched set skips (0: unconstrained)")
    ap.add_argument("--draft", default=d.draft, choices=DRAFT_KINDS,
                    help="draft weights the sets are searched for (matchness and costs of that kind)")
    ap.add_argument("--search-mode", default=d.search_mode, choices=CALIBRATION_MODES,
                    help="speed: maximise predicted tokens per unit time above --min-skip-ratio; "
                         "matchness: KNN-SSD's search, every set skips exactly --skip-ratio of the "
                         "sublayers and a greedy search maximises matchness; channels: no search, every "
                         "domain's set keeps the --channel-keep share of each MLP's channels that "
                         "matter most on its prompts (the static set: on all domains), the rest replaced "
                         "by their mean output")
    ap.add_argument("--channel-keep", type=float, default=d.channel_keep,
                    help="share of each MLP's channels a set keeps in --search-mode channels")
    ap.add_argument("--skip-ratio", type=float, default=d.skip_ratio,
                    help="share of the 2·L sublayers every set skips in --search-mode matchness")
    ap.add_argument("--check-margin", type=float, default=d.check_margin,
                    help="held-out matchness by which a domain set must beat the static set on its "
                         "own domain; a set that does not routes to the static set")
    ap.add_argument("--lookup-aware", action="store_true",
                    help="score matchness (search and domain check) only at positions where prompt "
                         "lookup would not draft, i.e. where the skip set drafts when lookup is on")
    ap.add_argument("--fresh", action="store_true",
                    help="ignore the matchness memo an interrupted run left in --out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reprofile", action="store_true",
                    help="only re-measure the latency model and the draft calibration (small head, "
                         "acceptance per draft kind) of an existing calibration")
    ap.add_argument("--latency-only", action="store_true",
                    help="with --reprofile: re-measure only the latency model (the draft head and "
                         "acceptance do not depend on the machine)")
    ap.add_argument("--rebuild-router", action="store_true",
                    help="only re-embed the anchors of an existing calibration with the current prompt "
                         "embedding and rebuild its router, routing report and UMAP (docs/routing.md)")
    ap.add_argument("--no-umap", action="store_true", help="skip the UMAP fit (no domain map in the app)")
    add_device_argument(ap)
    return ap


def settings_from_args(args: argparse.Namespace) -> CalibrationSettings:
    return CalibrationSettings(
        budget=args.budget, gamma=args.gamma, prompts_per_domain=args.prompts_per_domain,
        held_out_per_domain=args.held_out_per_domain, continuation_tokens=args.continuation_tokens,
        max_prompt_tokens=args.max_prompt_tokens, seed=args.seed, min_skip_ratio=args.min_skip_ratio,
        draft=args.draft, search_mode=args.search_mode, skip_ratio=args.skip_ratio,
        channel_keep=args.channel_keep, check_margin=args.check_margin, lookup_aware=args.lookup_aware,
        umap=not args.no_umap, resume=not args.fresh)


def main(argv=None):
    try:
        _main(argv)
    except ModelNotFoundError as exc:           # one sentence, no traceback (like python app.py)
        raise SystemExit(str(exc)) from None


def _main(argv=None):
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else cal_io.default_folder(args.model)
    if args.rebuild_router:
        cal = rebuild_router(out, args.model, device=args.device, umap=False if args.no_umap else None)
        print(json.dumps({"out": str(out), "embedding": cal.embedding, "routing": cal.routing}, indent=1))
        return
    if args.reprofile:
        cal = reprofile(out, args.model, device=args.device, latency_only=args.latency_only)
        print(json.dumps({"out": str(out), "latency_fit": cal.meta["latency_fit"],
                          "predicted_speedup": cal.meta["predicted_speedup"]}, indent=1))
        return
    cal = calibrate(args.model, out, settings_from_args(args), device=args.device)
    print(json.dumps({"out": str(out), "timings": cal.meta["timings"], "routing": cal.routing,
                      "search": cal.meta["search"], "check": cal.meta["check"],
                      "matchness": cal.matchness}, indent=1))


if __name__ == "__main__":
    main()
