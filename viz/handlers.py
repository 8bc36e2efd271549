"""The app's event handlers, without Gradio: generate, race, stop, examples, what-if, page load,
calibration and the plain API.

Every handler returns (or yields) a dict of named outputs — {"tokens": html, "stats": html, ...};
an output left out stays as it is, and a change of visibility is a viz.studio.Update. app.py turns
these dicts into Gradio's positional outputs in one place.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

from ssd_core.engine.decode import DecodeConfig, Start, decode, encode_for
from ssd_core.engine.generate import generate as core_generate, summarize
from ssd_core.engine.ties import logit_gap
from ssd_core.policies.ar import Autoregressive
from ssd_core.tools.metrics import first_difference
from viz import cost as vcost
from viz import stats as vstats
from viz import tokens as vtok
from viz.tokens import escape
from viz.session import (Run, Session, get_session, acceptance_star, cost_view, domains_views, visitor, layer_fig,
                         map_fig, route_view, stats_view, tokens_view, trace_download, vocab, NO_TRACE)
from viz.studio import (DEFAULT_DRAFT_LABEL, LABELS, STRATEGY_OF_LABEL, Studio, Update, clean_prompt, make_config,
                        make_strategy, problem, public_message, safe_k)

log = logging.getLogger("knn-ssd-studio")

# what the Generate and Race handlers update, by name
GEN_OUTPUTS = ("session", "tokens", "stats", "route", "domain_plot", "layer_plot", "race", "cost",
               "what_if", "trace_file")
# what a page load may update: a calibration installed after the layout was built
PAGE_OUTPUTS = ("session", "cal_row", "banner", "strategy", "k", "domain_plot", "layer_plot", "cost",
                "what_if", "domains_md", "sets_plot", "match_plot")


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


# --- page load ---------------------------------------------------------------------------------------
def page_load(studio: Studio, built_with, session) -> dict:
    """On page load: this visitor's own state (which also opens the event stream before the first
    click) and, if a calibration was installed after the layout was built, everything that shows it."""
    studio, session = visitor(studio, session)
    cal = studio.calibration
    if cal is built_with:
        # the UMAP may have finished loading in the background since the layout was built
        return dict(session=session, **({"domain_plot": map_fig(studio, None)} if studio.domain_map is not None
                                        else {}))
    text, sets, match = domains_views(studio)
    cost, what_if_fig = cost_view(studio, None, None)
    out = dict(session=session, cal_row=Update(visible=cal is None),
               strategy=Update(value="KNN-SSD" if cal else "autoregressive"),
               domain_plot=map_fig(studio, None), layer_plot=layer_fig(studio, None), cost=cost,
               what_if=what_if_fig, domains_md=text, sets_plot=Update(value=sets, visible=cal is not None),
               match_plot=Update(value=match, visible=cal is not None))
    if cal:
        out["k"] = Update(value=cal.router.k)
    return out


# --- the calibration chooser ------------------------------------------------------------------------------
CHOOSE_OUTPUTS = ("session", "route", "domain_plot", "layer_plot", "cost", "what_if", "domains_md", "sets_plot",
                  "match_plot", "k", "cal_info")


def choose_calibration(studio: Studio, session, name) -> dict:
    """This visitor's calibration (Studio.choices): their next runs route and draft with it, and every
    view of the calibration shows it; other visitors keep theirs. No model runs."""
    session = get_session(session)
    if name not in studio.choices:
        return dict(session=session, cal_info=calibration_info(studio, session.calibration))
    session.calibration = None if studio.choices[name].calibration is studio.calibration else name
    view = studio.for_visitor(session.calibration)
    cal = view.calibration
    text, sets, match = domains_views(view)
    cost, what_if_fig = cost_view(view, None, None)
    return dict(session=session, route=route_view(None), domain_plot=map_fig(view, None),
                layer_plot=layer_fig(view, None), cost=cost, what_if=what_if_fig, domains_md=text,
                sets_plot=sets, match_plot=match, k=Update(value=cal.router.k),
                cal_info=calibration_info(studio, name))


def calibration_info(studio: Studio, name: str | None) -> str:
    """The line under the chooser: what the picked calibration's domains draft with, and bench speed."""
    c = studio.choices.get(name) if name else next(iter(studio.choices.values()), None)
    if c is None:
        return ""
    return (f'<div class="cal-info">{escape(c.line)}<br><span class="cal-mem">Every calibration here drafts '
            f'from the one model: {escape(studio.draft_memory())}.</span></div>')


# --- the plain API -------------------------------------------------------------------------------------
def generate_text(studio: Studio, prompt: str, strategy: str = "KNN-SSD", max_new_tokens: float = 64,
                  gamma: float = 4, threshold: float = 0.0, temperature: float = 0.0,
                  top_p: float = 1.0, draft: str = DEFAULT_DRAFT_LABEL, seed=None, calibration: str = "") -> dict:
    """The plain API: one whole answer and its stats (gradio_client, the load test and tests).

    calibration: one of Studio.choices by name (blank: the served one).
    Bad input never raises: the answer is {"error": message} and the server keeps serving.
    """
    if calibration and calibration not in studio.choices:
        return {"error": f"unknown calibration {str(calibration)[:60]!r}; choose from {', '.join(studio.choices)}"}
    studio = studio.for_visitor(calibration or None)
    err, cfg = problem(prompt, lambda: make_config(max_new_tokens, gamma, threshold, temperature, top_p, draft,
                                                   seed, max_new_cap=studio.limits.max_new_tokens))
    if err:
        return {"error": err}
    name = STRATEGY_OF_LABEL.get(strategy, strategy if strategy in STRATEGY_OF_LABEL.values() else None)
    if name is None:
        return {"error": f"unknown strategy {str(strategy)[:40]!r}; choose from {', '.join(STRATEGY_OF_LABEL)}"}
    if studio.calibration is None:
        name = "ar"
    try:
        g = core_generate(studio.backbone, clean_prompt(prompt).strip(),
                          make_strategy(studio, name, cfg.gamma, 5, None, cfg.draft), cfg)
    except Exception as exc:        # the model failed on this request: say so, keep serving
        log.exception("generate_text failed")
        return {"error": model_failed(exc)}
    st = g.stats
    return {"text": g.text, "strategy": name, "new_tokens": st.new_tokens, "tau": round(st.tau, 3),
            "alpha": round(st.alpha, 3), "tokens_per_s": round(st.tokens_per_s, 2),
            "truncated": g.start.truncated, "domain": g.start.domain, "seed": cfg.seed,
            "calibration": studio.cal_folder.name if studio.calibration is not None else None}


def model_failed(exc: Exception) -> str:
    """What a visitor reads when decoding raised: the error in one line, no traceback, no server paths."""
    return f"The model failed on this request ({type(exc).__name__}: {public_message(str(exc))[:300]})."


# --- Generate and Race -------------------------------------------------------------------------------
def _stream(studio: Studio, session: Session, prompt: str, strategy: str, domain, cfg: DecodeConfig, k: int,
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
    yield from show_events(studio, session, run, timed(decode(bb, prompt, strat, cfg,
                                                             should_stop=lambda: session.stop)), cal_note)


def show_events(studio: Studio, session: Session, run: Run, events, note: str = "", verb: str = "generating"):
    """The Generate view of a run's (event, seconds) stream, live or replayed: tokens, stats, route, map,
    layer map — each figure sent only when it changes.

    The first token goes out alone; the two figures follow with the first step. Drawing them (Plotly,
    a few hundred ms of the browser's main thread on 2 cores) must not hold back the first token's paint."""
    parts: list[str] = []
    token_str, eos = vocab(studio, run)
    figures_due = False

    def figures() -> dict:
        return dict(domain_plot=map_fig(studio, run, session.map_whole), layer_plot=layer_fig(studio, run))

    for ev, dt in events:
        run.compute_s += dt
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
        update.update(tokens=tokens_view(studio, parts, f"{verb}…"), stats=stats_view(run, None, note))
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


def _request(studio: Studio, racing: bool, prompt, max_new, gamma, threshold, temperature, top_p, k, draft, seed):
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


def generate(studio: Studio, session, prompt, strategy_label, domain, max_new, gamma, threshold,
             temperature, top_p, k, draft=DEFAULT_DRAFT_LABEL, seed=None):
    """Generate: stream coloured tokens, stats and (when they change) the two figures."""
    yield from _speculate(studio, False, session, prompt, strategy_label, domain, max_new, gamma, threshold,
                          temperature, top_p, k, draft, seed)


def race(studio: Studio, session, prompt, strategy_label, domain, max_new, gamma, threshold,
         temperature, top_p, k, draft=DEFAULT_DRAFT_LABEL, seed=None):
    """Race: the chosen strategy (streamed) then autoregressive on the same prompt; speeds + lossless check."""
    yield from _speculate(studio, True, session, prompt, strategy_label, domain, max_new, gamma, threshold,
                          temperature, top_p, k, draft, seed)


def race_static(studio: Studio, session, prompt, strategy_label, domain, max_new, gamma, threshold,
                temperature, top_p, k, draft=DEFAULT_DRAFT_LABEL, seed=None):
    """Race vs static: the routed draft (KNN-SSD, or the chosen routing strategy) then the static draft on
    the same prompt and settings: what routing itself gains (τ, tokens/s, both sets)."""
    yield from _speculate(studio, True, session, prompt, strategy_label, domain, max_new, gamma, threshold,
                          temperature, top_p, k, draft, seed, against="static")


def _speculate(studio: Studio, racing: bool, session, prompt, strategy_label, domain, max_new, gamma,
               threshold, temperature, top_p, k, draft, seed=None, against: str = "ar"):
    """Generate's and Race's shared body: check the request, stream the strategy; then the cost panel
    (Generate) or the second lap and the lossless check (Race; against "ar": plain decoding, "static":
    the static draft). A decode that raises becomes a message in the token panel; the server keeps
    serving."""
    studio, session = visitor(studio, session)
    err, got = _request(studio, racing, prompt, max_new, gamma, threshold, temperature, top_p, k, draft, seed)
    if err:
        yield dict(session=session, tokens=vtok.stream_html("", placeholder=err, status="⚠ " + err))
        return
    (cfg, k, note), strategy = got, STRATEGY_OF_LABEL.get(strategy_label, "knn")
    session.race = None
    reset = {"trace_file": NO_TRACE}           # the last run's download link goes with the first update
    try:
        if racing and against == "static" and studio.calibration is None:
            yield dict(session=session, race=vstats.race_html(
                None, running="Race vs static needs a calibration (it has the static draft)."), **reset)
            return
        if racing:
            if strategy == "ar" or (against == "static" and strategy == "static"):
                strategy = "knn" if studio.calibration is not None else "ar"
            yield dict(session=session, race=vstats.race_html(None, running=f"1/2 · {LABELS[strategy]} running…"),
                       **reset)
            reset = {}
        for update in _stream(studio, session, clean_prompt(prompt).strip(), strategy, domain, cfg, int(k), note):
            yield dict(session=session, **update, **reset)
            reset = {}
        if not racing:
            cost, what_if_fig = cost_view(studio, session.run, None)
            yield dict(session=session, cost=cost, what_if=what_if_fig, race=vstats.race_html(None),
                       stats=stats_view(session.run, session.race),
                       trace_file=trace_download(studio, session))
            return
        yield from _second_lap(studio, session, prompt, cfg, against)
    except Exception as exc:        # noqa: BLE001 - a visitor sees a sentence, the log keeps the traceback
        log.exception("decode failed")
        msg = model_failed(exc)
        out = dict(session=session, tokens=vtok.stream_html("", placeholder=msg, status="⚠ " + msg))
        if racing:
            out["race"] = vstats.race_html(None, running="race stopped: the model failed")
        yield out


def _second_lap(studio: Studio, session: Session, prompt: str, cfg, against: str = "ar"):
    """The race's second lap on the same prompt: autoregressive ("ar") or the static draft ("static");
    then both speeds and the lossless check."""
    run = session.run
    name = "autoregressive" if against == "ar" else "static draft"
    if session.stop:
        yield dict(session=session, race=vstats.race_html(None, running="race stopped"))
        return
    yield dict(session=session, race=vstats.race_html(None, running=f"2/2 · {name} running…"))
    strategy = Autoregressive() if against == "ar" else make_strategy(studio, "static", cfg.gamma, 5, None, cfg.draft)
    ids2, time2, start2, steps2 = [], 0.0, None, []
    for ev, dt in timed(decode(studio.backbone, clean_prompt(prompt).strip(), strategy, cfg,
                               should_stop=lambda: session.stop)):
        time2 += dt
        if isinstance(ev, Start):
            start2 = ev
            ids2.append(ev.first_token)
        else:
            steps2.append(ev)
            ids2.extend(ev.committed)
        if len(ids2) % 16 == 0:
            yield dict(session=session, race=vstats.race_html(
                None, running=f"2/2 · {name}: {len(ids2)} of ≤ {cfg.max_new_tokens} tokens"))
    if session.stop:
        yield dict(session=session, race=vstats.race_html(None, running="race stopped"),
                   trace_file=trace_download(studio, session))
        return
    ids = run.token_ids
    same = tuple(ids2) == ids
    where = None if same else first_difference(ids2, ids)
    gap = None
    if where is not None and cfg.greedy and where < min(len(ids2), len(ids)):   # how close was that choice?
        prompt_ids = encode_for(studio.backbone, clean_prompt(prompt).strip(), cfg).ids
        gap = logit_gap(studio.backbone, prompt_ids, ids2[:where]).gap
    other = {}
    if against == "static":
        st2 = summarize(start2, steps2, time2)
        cal = studio.calibration
        other = dict(against="static draft", tau=run.stats.tau, against_tau=st2.tau,
                     sets=(run.skip.words() if run.skip else "no draft", cal.static.words()),
                     same_draft=run.skip is not None and run.skip.same_draft(cal.static))
    session.race = vstats.RaceResult(
        strategy=LABELS[run.strategy], ar_tokens_per_s=len(ids2) / time2 if time2 else 0.0,
        tokens_per_s=run.stats.tokens_per_s, ar_tokens=len(ids2), tokens=len(ids),
        identical=same if cfg.greedy else None, first_difference=where, tie_gap=gap, **other)
    cost, what_if_fig = cost_view(studio, run, session.race)
    yield dict(session=session, race=vstats.race_html(session.race), stats=stats_view(run, session.race),
               cost=cost, what_if=what_if_fig, trace_file=trace_download(studio, session))


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
