"""The races, without Gradio: Race vs AR and Race vs static. The chosen strategy runs first (streamed, the
same view as Generate), then autoregressive decoding or the static draft on the same prompt and settings;
then both speeds and the lossless check (where greedy texts part: how close that choice was)."""
from __future__ import annotations

import logging

from ssd_core.engine.decode import Start, decode, encode_for
from ssd_core.engine.generate import summarize
from ssd_core.engine.ties import logit_gap
from ssd_core.policies.ar import Autoregressive
from ssd_core.tools.metrics import first_difference
from viz import stats as vstats
from viz.handlers import failed, refused, request_settings, run_stream, timed
from viz.session import NO_TRACE, Session, cost_view, stats_view, trace_download, visitor
from viz.studio import DEFAULT_DRAFT_LABEL, LABELS, STRATEGY_OF_LABEL, Studio, clean_prompt, make_strategy

log = logging.getLogger("knn-ssd-studio")


def race(studio: Studio, session, prompt, strategy_label, domain, max_new, gamma, threshold,
         temperature, top_p, k, draft=DEFAULT_DRAFT_LABEL, seed=None):
    """Race: the chosen strategy (streamed) then autoregressive on the same prompt; speeds + lossless check."""
    yield from _race(studio, session, prompt, strategy_label, domain, max_new, gamma, threshold, temperature,
                     top_p, k, draft, seed)


def race_static(studio: Studio, session, prompt, strategy_label, domain, max_new, gamma, threshold,
                temperature, top_p, k, draft=DEFAULT_DRAFT_LABEL, seed=None):
    """Race vs static: the routed draft (KNN-SSD, or the chosen routing strategy) then the static draft on
    the same prompt and settings: what routing itself gains (τ, tokens/s, both sets)."""
    yield from _race(studio, session, prompt, strategy_label, domain, max_new, gamma, threshold, temperature,
                     top_p, k, draft, seed, against="static")


def _race(studio: Studio, session, prompt, strategy_label, domain, max_new, gamma, threshold, temperature, top_p,
          k, draft, seed=None, against: str = "ar"):
    """Both races' body: check the request, stream the strategy, then the second lap and the lossless check
    (against "ar": plain decoding, "static": the static draft). A decode that raises becomes a message in
    the token panel; the server keeps serving."""
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
        # the last run's download link goes with the first update
        yield dict(session=session, race=vstats.race_html(None, running=f"1/2 · {LABELS[strategy]} running…"),
                   trace_file=NO_TRACE)
        for update in run_stream(studio, session, clean_prompt(prompt).strip(), strategy, domain, cfg, int(k), note):
            yield dict(session=session, **update)
        yield from _second_lap(studio, session, prompt, cfg, against)
    except Exception as exc:        # noqa: BLE001 - a visitor sees a sentence, the log keeps the traceback
        log.exception("decode failed")
        yield dict(failed(session, exc), race=vstats.race_html(None, running="race stopped: the model failed"))


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
