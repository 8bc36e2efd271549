"""The measurements `calibrate` composes beyond the search: prompt embeddings, the domain check,
routing on prompts written after the anchors, KnapSpec κ's points and the predicted speedups."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..engine.backbone import Backbone
from ..policies.knapspec import prompt_similarity
from .domains import DOMAIN_DIR, load_prompts
from .router import Router

ROUTING_CHECK_DIR = DOMAIN_DIR.parent / "routing_check"


def embed_prompts(bb: Backbone, prompts: list[str], max_prompt_tokens: int, desc: str,
                  progress: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the embedding the router reads (backbone.EMBEDDING), and for the routing report's comparison the
    user-token mean and the whole-template mean) from the prefill's final-norm hidden states."""
    used, user, whole = [], [], []
    for p in tqdm(prompts, desc=desc, disable=not progress, leave=False):
        ids = bb.encode(p, max_tokens=max_prompt_tokens)
        pre = bb.prefill(ids, bb.new_cache(len(ids) + 1), keep_hidden=True)
        a, b = ids.user_span
        if b <= a:
            a, b = 0, len(ids)
        used.append(pre.embedding.float().cpu().numpy())
        user.append(pre.hidden[a:b].mean(0).float().cpu().numpy())
        whole.append(pre.hidden.mean(0).float().cpu().numpy())
    return np.stack(used), np.stack(user), np.stack(whole)


def kappa_points(bb, results, prompts_by_domain, max_prompt_tokens) -> list[tuple[float, float]]:
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
