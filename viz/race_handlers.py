"""The races, without Gradio: Race vs AR and Race vs static. The chosen strategy and its opponent
(autoregressive decoding, or the static draft) decode the same prompt with the same settings in lockstep
(engine.race: whichever lap is behind steps next, each lap's first step warms up uncounted); the chosen
strategy streams as Generate does; then both decode-phase speeds, the run's own costs and the lossless
check (where greedy texts part: how close that choice was)."""
from __future__ import annotations

import logging

from ssd_core.engine.decode import Start, encode_for
from ssd_core.engine.generate import summarize
from ssd_core.engine.race import lockstep, measured_costs, segment_ratios
from ssd_core.engine.ties import logit_gap
from ssd_core.policies.ar import Autoregressive
from ssd_core.tools.metrics import first_difference
from viz import stats as vstats
from viz.handlers import Later, coalesce, failed, update_every, refused, request_settings, show_events
from viz.session import NO_TRACE, Run, Session, batch_view, cost_view, stats_view, trace_download, visitor
from viz.studio import DEFAULT_DRAFT_LABEL, LABELS, STRATEGY_OF_LABEL, Studio, clean_prompt, make_strategy

log = logging.getLogger("knn-ssd-studio")

def race(studio: Studio, session, prompt, strategy_label, domain, max_new, gamma, threshold,
         temperature, top_p, k, draft=DEFAULT_DRAFT_LABEL, seed=None):
    """Race: the chosen strategy (streamed) and autoregressive decoding in lockstep on the same prompt;
    speeds + lossless check."""
    yield from _race(studio, session, prompt, strategy_label, domain, max_new, gamma, threshold, temperature,
                     top_p, k, draft, seed)


def race_static(studio: Studio, session, prompt, strategy_label, domain, max_new, gamma, threshold,
                temperature, top_p, k, draft=DEFAULT_DRAFT_LABEL, seed=None):
    """Race vs static: the routed draft (KNN-SSD, or the chosen routing strategy) and the static draft in
    lockstep on the same prompt and settings: what routing itself gains (τ, tokens/s, both sets)."""
    yield from _race(studio, session, prompt, strategy_label, domain, max_new, gamma, threshold, temperature,
                     top_p, k, draft, seed, against="static")


def _race(studio: Studio, session, prompt, strategy_label, domain, max_new, gamma, threshold, temperature, top_p,
          k, draft, seed=None, against: str = "ar"):
    """Both races' body: check the request, run the laps, then the verdict (against "ar": plain decoding,
    "static": the static draft). A decode that raises becomes a message in the token panel; the server
    keeps serving."""
    studio, session = visitor(studio, session)
    err, got = request_settings(studio, True, prompt, max_new, gamma, threshold, temperature, top_p, k, draft, seed)
    if err:
        yield refused(session, err)
        return
    (cfg, k, note), strategy = got, STRATEGY_OF_LABEL.get(strategy_label, "knn")
    session.race = None
    try:
        if against == "static" and studio.calibration is None:
            yield dict(session=session, race=vstats.race_html(
                None, running="Race vs static needs a calibration (it has the static draft)."), trace_file=NO_TRACE)
            return
        if strategy == "ar" or (against == "static" and strategy == "static"):
            strategy = "knn" if studio.calibration is not None else "ar"
        name = "autoregressive" if against == "ar" else "static draft"
        # the last run's download link goes with the first update
        yield dict(session=session, race=vstats.race_html(None, running=f"{LABELS[strategy]} and {name} "
                                                                         "running in lockstep…"), trace_file=NO_TRACE)
        with studio.quiet.job():
            yield from coalesce(_laps(studio, session, clean_prompt(prompt).strip(), strategy, domain, cfg, int(k),
                                      note, against), update_every(studio))
    except Exception as exc:        # noqa: BLE001 - a visitor sees a sentence, the log keeps the traceback
        log.exception("decode failed")
        yield dict(failed(session, exc), race=vstats.race_html(None, running="race stopped: the model failed"))


def _laps(studio: Studio, session: Session, prompt: str, strategy: str, domain, cfg, k: int, note: str,
          against: str):
    """Both laps in lockstep: the chosen strategy's events drive the Generate view, the other lap's
    progress shows in the race panel; then the verdict."""
    bb = studio.backbone
    run = Run(prompt, strategy, cfg)
    session.run, session.stop = run, False
    mine = make_strategy(studio, strategy, cfg.gamma, k, domain, cfg.draft)
    other = Autoregressive() if against == "ar" else make_strategy(studio, "static", cfg.gamma, 5, None, cfg.draft)
    name = "autoregressive" if against == "ar" else "static draft"
    laps = {}

    def my_events():
        for side, ev, lap in lockstep(bb, prompt, mine, other, cfg, should_stop=lambda: session.stop):
            laps[side] = lap
            if side == "a":
                yield ev, (lap.start_s if isinstance(ev, Start) else lap.step_s[-1])

    def progress():
        b = laps.get("b")
        done = b.committed if b is not None else 0
        return vstats.race_html(
            None, running=f"lockstep · {LABELS[strategy]}: {run.stats.new_tokens if run.stats else 0} · {name}: "
                          f"{done} of ≤ {cfg.max_new_tokens} tokens")
    first = {"session": session}              # the session once (the same object goes again at the end)
    for update in show_events(studio, session, run, my_events(), note):
        yield dict(**update, **first, race=Later(progress))      # rendered only if it goes out (coalesce)
        first = {}
    a, b = laps.get("a"), laps.get("b")
    if session.stop or a is None or b is None:
        yield dict(session=session, race=vstats.race_html(None, running="race stopped"),
                   trace_file=trace_download(studio, session))
        return
    yield _verdict(studio, session, run, a, b, cfg, against)


def _verdict(studio: Studio, session: Session, run: Run, a, b, cfg, against: str) -> dict:
    """Both laps done: speeds (decode phase), the run's own costs, the lossless check."""
    ids, ids2 = a.token_ids, b.token_ids
    same = ids2 == ids
    where = None if same else first_difference(ids2, ids)
    gap = None
    if where is not None and cfg.greedy and where < min(len(ids2), len(ids)):   # how close was that choice?
        prompt_ids = encode_for(studio.backbone, run.prompt, cfg).ids
        gap = logit_gap(studio.backbone, prompt_ids, list(ids2[:where])).gap
    other = {}
    if against == "static":
        cal = studio.calibration
        other = dict(against="static draft", tau=run.stats.tau, against_tau=summarize(b.start, b.steps, 1.0).tau,
                     sets=(run.skip.words() if run.skip else "no draft", cal.static.words()),
                     same_draft=run.skip is not None and run.skip.same_draft(cal.static))
    else:
        other = dict(costs=measured_costs(a, b))
    thirds = segment_ratios(a, b)
    session.race = vstats.RaceResult(
        strategy=LABELS[run.strategy], ar_tokens_per_s=b.tokens_per_s, tokens_per_s=a.tokens_per_s,
        ar_tokens=len(ids2), tokens=len(ids), identical=same if cfg.greedy else None, first_difference=where,
        tie_gap=gap, spread=(min(thirds), max(thirds)) if len(thirds) > 1 else None, **other)
    cost, what_if_fig = cost_view(studio, run, session.race)
    return dict(session=session, race=vstats.race_html(session.race), stats=stats_view(run, session.race),
                cost=cost, what_if=what_if_fig, batch_plot=batch_view(studio, run),
                trace_file=trace_download(studio, session))
