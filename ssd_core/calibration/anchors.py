"""The KNN router from the anchor prompts: embed them with the prefill's pooling, build and centre the
router, measure routing (held-out and assets/routing_check/); and rebuild only the router of an existing
calibration when the prompt embedding changes (`python -m ssd_core.calibrate --rebuild-router`)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..engine.backbone import EMBEDDING, Backbone
from ..engine.loading import load_backbone
from . import artifact as cal_io
from .domains import load_prompts, split
from .router import Router, suggest_threshold
from .steps import embed_prompts, routing_check
from .umap_map import DomainMap

# the routing report's name for the pooling the router reads (compared with "user": the user-token mean,
# and "all": the whole-template mean)
USED_POOLING = "last"


def build_router(bb: Backbone, splits: dict, domain_sets: dict, static_skip, seed: int,
                 max_prompt_tokens: int, progress: bool = True) -> tuple[Router, dict]:
    """The KNN router on the prompt embedding (backbone.EMBEDDING, centred), and the routing report.

    splits: domain → (calibration prompts = anchors, held-out prompts for the threshold and accuracy).
    The report compares the poolings (the last token's, the user-token mean, the whole-template mean),
    names the one used ("used") and its embedding kind, and adds routing on assets/routing_check/.
    """
    emb = {d: [embed_prompts(bb, part, max_prompt_tokens, f"embed {d}/{which}", progress)
               for which, part in zip(("cal", "held"), s)] for d, s in splits.items()}
    used = USED_POOLING
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
    # The app and the bench route on the prefill's embedding (decode.Start.embedding).
    routing["used"] = used
    routing["embedding"] = EMBEDDING
    router = routers[used]
    outside = routing_check(router, bb, max_prompt_tokens, progress=progress)
    if outside is not None:
        routing["check_set"] = outside
    return router, routing


def rebuild_router(folder: Path, model: str | None = None, progress: bool = True,
                   device: str | torch.device = "auto", backbone: Backbone | None = None,
                   umap: bool | None = None) -> cal_io.Calibration:
    """Re-embed an existing calibration's anchors with today's embedding (backbone.EMBEDDING) and
    rebuild its router, routing report and (if it had one, or `umap`) its UMAP; the rest stays. The way
    to serve a calibration made on an embedding this version no longer computes (the user-token mean).

    The anchors are the calibration split of the domain files it was made from (load checks their
    hash), so the skip sets stay valid."""
    folder = Path(folder)
    bb = backbone or load_backbone(model, threads=torch.get_num_threads(), device=device)
    cal = cal_io.load(folder, bb, any_embedding=True)     # its router is replaced below
    had_map = "umap.joblib" in cal.meta.get("files", {})
    refit = had_map if umap is None else umap
    if had_map and not refit:                # its map would place new prompts among the old anchors
        raise ValueError(f"{folder} has a domain map fitted on its old anchor vectors; a router rebuild "
                         "refits it too (leave out --no-umap)")
    settings = cal.meta["settings"]
    splits = {d: split(ps) for d, ps in load_prompts().items()}
    t = time.perf_counter()
    router, routing = build_router(bb, splits, cal.domain_sets, cal.static, settings["seed"],
                                   settings["max_prompt_tokens"], progress)
    cal.router = router.with_settings(k=cal.router.k, vote=cal.router.vote)
    cal.routing = routing
    cal.meta.setdefault("timings", {})["router_s"] = round(time.perf_counter() - t, 1)
    cal.meta["embedding"] = EMBEDDING
    domain_map = None
    if refit:
        t = time.perf_counter()
        domain_map = DomainMap.fit(router.vectors, seed=settings["seed"])
        cal.meta["timings"]["umap_s"] = round(time.perf_counter() - t, 1)
    cal.meta.pop("files", None)
    cal_io.save(cal, folder, domain_map)
    return cal_io.load(folder, bb)
