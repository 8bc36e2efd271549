"""The Generate tab's event handlers, without Gradio: generate, stop and the small controls (examples,
strategy, map zoom, what-if); and what the other event modules share: the live view of a run's events
(show_events, run_stream) and the request check.

The races: viz.race_handlers; page load and the calibration chooser: viz.page_handlers; the plain API:
viz.api_handlers; step-through and replay: viz.walk_handlers, viz.trace_handlers.

Every handler returns (or yields) a dict of named outputs — {"tokens": html, "stats": html, ...};
an output left out stays as it is, and a change of visibility is a viz.studio.Update. app.py turns
these dicts into Gradio's positional outputs in one place.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from ssd_core.engine.decode import DecodeConfig, Start, Waiting, decode
from viz import cost as vcost
from viz import stats as vstats
from viz import tokens as vtok
from viz.api_handlers import model_failed
from viz.session import (Run, Session, acceptance_star, batch_view, cost_view, visitor, layer_fig, map_fig,
                         route_view, stats_view, tokens_view, trace_download, vocab, NO_TRACE)
from viz.studio import (DEFAULT_DRAFT_LABEL, STRATEGY_OF_LABEL, Studio, Update, clean_prompt, make_config,
                        make_strategy, problem, safe_k)

log = logging.getLogger("knn-ssd-studio")

# what the Generate and Race handlers update, by name
GEN_OUTPUTS = ("session", "tokens", "stats", "route", "domain_plot", "layer_plot", "race", "cost",
               "what_if", "batch_plot", "trace_file")


UPDATE_EVERY_S = 0.2      # at most ~5 page updates a second while a model runs (tokens coalesced)


class Later:
    """A view rendered only if it goes out: coalesce drops most of a run's updates in a crowd, and rendering
    every step's whole token stream and stats (for nothing) held the GIL the engine's steps need."""

    __slots__ = ("render",)

    def __init__(self, render):
        self.render = render


def _rendered(update: dict) -> dict:
    return {k: v.render() if isinstance(v, Later) else v for k, v in update.items()}


def coalesce(updates, every_s=None):
    """Named-output dicts merged so that at most one goes out every `every_s` (default UPDATE_EVERY_S; a
    callable is asked again at each update; the first goes at once, the last always): each page update
    costs the server work beside the decode, on the same two cores."""
    every_s = UPDATE_EVERY_S if every_s is None else every_s
    pending, last = {}, float("-inf")
    for update in updates:
        pending.update(update)
        now = time.monotonic()
        if now - last >= (every_s() if callable(every_s) else every_s):
            yield _rendered(pending)
            pending, last = {}, now
    if pending:
        yield _rendered(pending)


def update_every(studio: Studio):
    """Seconds between one visitor's page updates, growing with the rows the engine serves (≤ 5 a second
    alone, ~1 a second for 16): Gradio's work per update (serialising, the event loop) holds the GIL the
    engine's steps also need, so a class's 80 updates a second slowed every answer."""
    engine = getattr(studio, "engine", None)
    return lambda: UPDATE_EVERY_S * max(1.0, (engine.last_rows if engine is not None else 1) / 4)


def timed(events):
    """Yield (event, seconds spent producing it): model time, without the UI's time between steps."""
    while True:
        t = time.perf_counter()
        try:
            ev = next(events)
        except StopIteration:
            return
        yield ev, time.perf_counter() - t


def _in_use(studio: Studio, run: Run, start: Start):
    """The route to show and the first skip set, from the Start event."""
    cal = studio.calibration
    route, used = (start.route.to_dict() if start.route else None), start.route is not None
    if route is None and cal is not None and not run.foreign:   # where KNN *would* send it, marked not used
        route = cal.router.route(start.embedding).to_dict()
    skip = start.skip if run.strategy != "ar" else None
    return route, used, skip


# --- a run, live or replayed -----------------------------------------------------------------------------
def run_stream(studio: Studio, session: Session, prompt: str, strategy: str, domain, cfg: DecodeConfig, k: int,
            note: str = ""):
    """Decode and yield view updates (dicts); the finished Run is left in session.run."""
    cal_note = note
    if studio.calibration is None and strategy != "ar":
        cal_note += "No calibration for this model yet, so this runs autoregressively. "
        strategy = "ar"
    bb = studio.backbone
    run = Run(prompt, strategy, cfg)
    session.run, session.stop = run, False
    strat = make_strategy(studio, strategy, cfg.gamma, k, domain, cfg.draft)
    events = decode(bb, prompt, strat, cfg, should_stop=lambda: session.stop, report_wait=True)
    with studio.quiet.job():          # background measurements wait for it (profiles.Quiet)
        yield from coalesce(show_events(studio, session, run, timed(events), cal_note), update_every(studio))


def show_events(studio: Studio, session: Session, run: Run, events, note: str = "", verb: str = "generating"):
    """The Generate view of a run's (event, seconds) stream, live or replayed: tokens, stats, route, map,
    layer map — each figure sent only when it changes. A `Waiting` event (the serving engine has no room in
    its batch yet) shows the request's place in the token panel's status; its time is not model time.

    The first token goes out alone; the two figures follow with the first step. Drawing them (Plotly,
    a few hundred ms of the browser's main thread on 2 cores) must not hold back the first token's paint."""
    parts: list[str] = []
    token_str, eos = vocab(studio, run)
    figures_due = False

    def figures() -> dict:
        return dict(domain_plot=map_fig(studio, run, session.map_whole), layer_plot=layer_fig(studio, run))

    waited = False
    for ev, dt in events:
        if isinstance(ev, Waiting):
            waited = True
            yield dict(tokens=tokens_view(studio, parts, waiting_words(ev)))
            continue
        # after a wait, the Start's own seconds are its prefill's: the rest was waiting for room in the batch
        run.compute_s += ev.prefill_s if waited and isinstance(ev, Start) else dt
        if isinstance(ev, Start):
            run.start = ev
            run.route, run.route_used, skip = _in_use(studio, run, ev)
            if skip is not None:
                run.history.append((0, skip))
            parts.append(vtok.tokens_html(vtok.start_tokens(ev.first_token, token_str, eos)))
            shortened = note + ("The prompt was shortened to fit. " if ev.truncated else "")
            yield dict(tokens=tokens_view(studio, parts, f"{verb}…"),
                       stats=stats_view(run, None, shortened),
                       route=route_view(run, studio.calibration.static if studio.calibration else None))
            figures_due = True
            continue
        run.steps.append(ev)
        update = {}
        changed = ev.skip is not None and (run.skip is None or ev.skip != run.skip)
        if changed:
            run.history.append((ev.index + 1, ev.skip))
        if figures_due:
            update, figures_due = figures(), False
        elif changed:
            update["layer_plot"] = layer_fig(studio, run)
        parts.append(vtok.tokens_html(vtok.step_tokens(ev, token_str, eos)))
        update.update(tokens=Later(lambda: tokens_view(studio, parts, f"{verb}…")),
                      stats=Later(lambda: stats_view(run, None, note)))
        yield update
    if figures_due:                       # the run ended (or was stopped) before its first step
        yield figures()
    stopped = session.stop
    st = run.stats
    if st is None:
        return
    done = (f"stopped after {st.new_tokens} tokens" if stopped else
            f"done · {st.new_tokens} tokens in {len(run.steps)} steps · {st.wall_s:.2f} s model time")
    done += " · hover a token for its step, draft probability and the verifier's choice"
    yield dict(tokens=tokens_view(studio, parts, done))


def waiting_words(ev: Waiting) -> str:
    """The token panel's status while a request waits for room in the serving engine's batch."""
    reason = f" ({vtok.escape(ev.reason)})" if ev.reason else ""
    return f"waiting for room in the batch: position {ev.position}{reason}"


def request_settings(studio: Studio, racing: bool, prompt, max_new, gamma, threshold, temperature, top_p, k, draft, seed):
    """(error message, (config, K, note)) from the Generate tab's settings. A Race decodes twice, so its laps
    are capped shorter (the note says so when that shortens the request)."""
    lim = studio.limits

    def make():
        cfg = make_config(max_new, gamma, threshold, temperature, top_p, draft, seed, max_new_cap=lim.max_new_tokens)
        note = ""
        if racing and cfg.max_new_tokens > lim.race_max_new_tokens:
            cfg = replace(cfg, max_new_tokens=lim.race_max_new_tokens)
            note = f"A Race runs twice, so each lap stops at {lim.race_max_new_tokens} tokens here. "
        return cfg, safe_k(k), note
    return problem(prompt, make)


def refused(session: Session, err: str) -> dict:
    """A request the checks turned down: the reason in the token panel."""
    return dict(session=session, tokens=vtok.stream_html("", placeholder=err, status="⚠ " + err))


def failed(session: Session, exc: Exception) -> dict:
    """A decode that raised: one sentence in the token panel (the caller logs the traceback)."""
    msg = model_failed(exc)
    return dict(session=session, tokens=vtok.stream_html("", placeholder=msg, status="⚠ " + msg))


# --- Generate and Stop -----------------------------------------------------------------------------------
def generate(studio: Studio, session, prompt, strategy_label, domain, max_new, gamma, threshold,
             temperature, top_p, k, draft=DEFAULT_DRAFT_LABEL, seed=None):
    """Generate: stream coloured tokens, stats and (when they change) the two figures, then the cost panel.
    A decode that raises becomes a message in the token panel; the server keeps serving."""
    studio, session = visitor(studio, session)
    err, got = request_settings(studio, False, prompt, max_new, gamma, threshold, temperature, top_p, k, draft,
                                seed)
    if err:
        yield refused(session, err)
        return
    (cfg, k, note), strategy = got, STRATEGY_OF_LABEL.get(strategy_label, "knn")
    session.race = None
    # the first update carries the session (it may be new) and resets the last run's download link; later
    # ones only what changed (the session is the same object, sent again at the end)
    first = {"trace_file": NO_TRACE, "session": session}
    try:
        for update in run_stream(studio, session, clean_prompt(prompt).strip(), strategy, domain, cfg, int(k),
                                 note):
            yield dict(**update, **first)
            first = {}
        cost, what_if_fig = cost_view(studio, session.run, None)
        yield dict(session=session, cost=cost, what_if=what_if_fig, batch_plot=batch_view(studio, session.run),
                   race=vstats.race_html(None),
                   stats=stats_view(session.run, session.race), trace_file=trace_download(studio, session))
    except Exception as exc:        # noqa: BLE001 - a visitor sees a sentence, the log keeps the traceback
        log.exception("decode failed")
        yield failed(session, exc)


def stop(studio: Studio, session) -> dict:
    """Stop: the running decode ends at its next step (Gradio also cancels the event); show where."""
    studio, session = visitor(studio, session)
    session.stop = True
    run = session.run
    if run is None or run.start is None:
        return dict(session=session)
    token_str, eos = vocab(studio, run)
    parts = [vtok.tokens_html(vtok.start_tokens(run.start.first_token, token_str, eos))]
    parts += [vtok.tokens_html(vtok.step_tokens(s, token_str, eos)) for s in list(run.steps)]
    status = f"stopped after {run.stats.new_tokens} tokens"
    return dict(session=session, tokens=tokens_view(studio, parts, status), stats=stats_view(run, None))


# --- small controls ------------------------------------------------------------------------------------
def pick_example(studio: Studio, session, domain: str) -> dict:
    """An example button: the next held-out prompt of that domain (cycling), and the oracle's domain."""
    studio, session = visitor(studio, session)
    prompts = studio.examples.get(domain) or [""]
    i = session.example_turn.get(domain, 0)
    session.example_turn[domain] = i + 1
    return dict(session=session, prompt=prompts[i % len(prompts)], oracle_domain=domain)


def strategy_changed(strategy_label) -> dict:
    return dict(oracle_domain=Update(visible=STRATEGY_OF_LABEL.get(strategy_label) == "oracle"))


MAP_VIEWS = ("neighbourhood", "whole map")


def map_zoom(studio: Studio, session, view) -> dict:
    """The domain map's toggle: the last run's map, zoomed to its neighbourhood or whole (no model run);
    the choice also holds for this session's next runs."""
    studio, session = visitor(studio, session)
    session.map_whole = view == MAP_VIEWS[1]
    return dict(session=session, domain_plot=map_fig(studio, session.run, session.map_whole))


def what_if(studio: Studio, session, gamma, verify) -> dict:
    """The cost tab's what-if chart at another γ / verify cost."""
    studio, session = visitor(studio, session)
    cal = studio.calibration
    run = session.run
    c, alpha, c_big = 0.8, None, None
    if cal is not None:
        skip = run.skip if run is not None and run.skip is not None else cal.static
        c = cal.latency.draft_cost(skip, 256)
        c_big = 1.0 - studio.backbone.skip_weight_ratio(skip)
        stats = run.stats if run is not None else None
        alpha, label = acceptance_star(stats, int(gamma), cal.acceptance()["static"])
        return dict(what_if=vcost.what_if_figure(int(gamma), c, float(verify), alpha, c_big=c_big, label=label))
    return dict(what_if=vcost.what_if_figure(int(gamma), c, float(verify), alpha, c_big=c_big))
