"""Step through: a live decode advanced one phase (draft → verify → accept) per click, without Gradio.

Each handler returns (or, for auto-play, yields) named outputs: {"session": ..., "walk": html}.
"""
from __future__ import annotations

import html
import logging
import time

from ssd_core.engine.decode import decode
from viz import stepthrough as vwalk
from viz.session import Walk, get_session, visitor
from viz.studio import (STRATEGY_OF_LABEL, Studio, clean_prompt, make_config, make_strategy, problem,
                        public_message, safe_k)

log = logging.getLogger("knn-ssd-studio")


def walk_view(studio: Studio, walk: Walk | None) -> str:
    if walk is None:
        return vwalk.walk_html("", None, "draft", studio.backbone.token_str)
    if walk.done and walk.step is None:
        return '<div class="walk idle">The answer is complete. Press <b>Start</b> for another prompt.</div>'
    if walk.replay is not None:         # a replayed trace: its own token texts, no tokenizer
        token_str, text = walk.replay.token_str, "".join(map(walk.replay.token_str, walk.ids))
    else:
        token_str, text = studio.backbone.token_str, studio.backbone.decode(walk.ids)
    return vwalk.walk_html(walk.prompt + "\n\n" + text, walk.step, walk.phase, token_str, walk.skip_desc)


def _advance(walk: Walk) -> None:
    """Commit the current step to the context and move to the next one."""
    if walk.step is not None:
        walk.ids.extend(walk.step.committed)
        if walk.step.finished:
            walk.step, walk.done = None, True
            return
    walk.step = walk.steps[walk.next_index] if walk.next_index < len(walk.steps) else None
    walk.next_index += 1
    walk.phase = "draft"
    if walk.step is None:
        walk.done = True


def walk_start(studio: Studio, session, prompt, strategy_label, domain, gamma, k):
    """Start: decode the answer (up to the server's walk cap) in one go, in the model's lane; the clicks
    and auto-play then show its steps without running the model."""
    studio, session = visitor(studio, session)
    if not clean_prompt(prompt).strip():
        return dict(session=session,
                    walk='<div class="walk idle">Type a prompt first (or click an example).</div>')
    strategy = STRATEGY_OF_LABEL.get(strategy_label, "knn")
    if strategy == "ar" or studio.calibration is None:
        strategy = "knn" if studio.calibration is not None else "ar"
    # teaching: model drafts only (no lookup), so every draft shows the draft's probabilities
    cap = studio.limits.walk_max_new_tokens
    err, got = problem(prompt, lambda: (make_config(cap, gamma, 0.0, 0.0, 1.0, "int8", max_new_cap=cap),
                                        safe_k(k)))
    if err:
        return dict(session=session, walk=f'<div class="walk idle">{html.escape(err)}</div>')
    cfg, k = got
    strat = make_strategy(studio, strategy, cfg.gamma, k, domain, cfg.draft)
    try:
        with studio.quiet.job():
            start, *steps = decode(studio.backbone, clean_prompt(prompt).strip(), strat, cfg)
    except Exception as exc:                       # the model failed: say so, keep serving
        log.exception("step-through decode failed")
        return dict(session=session, walk=f'<div class="walk idle">⚠ The model failed on this prompt: '
                                          f'{html.escape(public_message(str(exc)))}</div>')
    session.walk = start_walk(clean_prompt(prompt).strip(), start, tuple(steps))
    return dict(session=session, walk=walk_view(studio, session.walk))


def start_walk(prompt: str, start, steps, replay=None) -> Walk:
    """A walk from a run's Start and its Steps (a finished decode or a replayed trace)."""
    route = start.route.to_dict() if start.route else None
    skip = start.skip.to_dict() if start.skip else None
    desc = (f"the {route['domain'] or 'static'} set's {len(skip['attn'])} attention + {len(skip['mlp'])} MLP "
            "sublayers" if route and skip else
            f"{len(skip['attn'])} attention + {len(skip['mlp'])} MLP sublayers" if skip else "some sublayers")
    walk = Walk(tuple(steps), prompt, desc, ids=[start.first_token], replay=replay)
    _advance(walk)
    return walk


def walk_phase(studio: Studio, session, phase: str):
    studio, session = visitor(studio, session)
    if session.walk is not None and session.walk.step is not None:
        session.walk.phase = phase
    return dict(session=session, walk=walk_view(studio, session.walk))


def walk_next(studio: Studio, session):
    studio, session = visitor(studio, session)
    if session.walk is not None and not session.walk.done:
        _advance(session.walk)
    return dict(session=session, walk=walk_view(studio, session.walk))


def walk_auto(studio: Studio, session, steps: int = 8, pause: float | None = None):
    """Auto-play: draft → verify → accept → next, a pause between phases (the walk's own by default:
    a replayed trace plays at the replay's speed). It only shows steps decoded at Start, so it runs in
    a lane of its own and its pauses never hold the model's."""
    studio, session = visitor(studio, session)
    walk = session.walk
    if walk is None:
        yield dict(session=session, walk=walk_view(studio, None))
        return
    for _ in range(int(steps)):
        for phase in vwalk.PHASES:
            if walk.step is None:
                return
            walk.phase = phase
            yield dict(session=session, walk=walk_view(studio, walk))
            time.sleep(walk.pause if pause is None else pause)
        _advance(walk)
        if walk.done:
            yield dict(session=session, walk=walk_view(studio, walk))
            return


def stop_walk(session) -> dict:
    session = get_session(session)
    session.stop = True
    return dict(session=session)
