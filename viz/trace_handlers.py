"""Traces in the app, without Gradio: every run can be downloaded as a trace, and a trace replays in the
Generate view and the Step-through without running the model, at a chosen speed.

A replay feeds the recorded events through the same view code as a live run (viz.handlers.show_events),
so it shows the same coloured tokens, route, map, layer map, stats and cost panel.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import time

from ssd_core.engine.trace import Trace, TraceError
from viz import stats as vstats
from viz import tokens as vtok
from viz.handlers import GEN_OUTPUTS, coalesce, show_events
from viz.session import Run, Walk, cost_view, visitor, stats_view, trace_download
from viz.studio import LABELS, Studio
from viz.walk_handlers import start_walk, walk_view

# what a replay updates: the Generate view, the Step-through and the prompt box
REPLAY_OUTPUTS = GEN_OUTPUTS + ("walk", "prompt")
# replay speeds: label → factor on the recorded step times (None: no pauses)
SPEEDS = {"0.5×": 0.5, "1×": 1.0, "2×": 2.0, "4×": 4.0, "instant": None}
DEFAULT_SPEED = "1×"
MAX_PAUSE_S = 2.0                  # no single step holds the replay longer than this
UPDATE_EVERY_S = 0.25             # a replay sends the page at most one update per this
UPLOADS_KEPT = 8                   # parsed uploads kept for visitors who upload the same file


def _seconds(x) -> float:
    """A recorded time as a pause: negative or not finite (a hand-edited file) counts as no time."""
    return x if isinstance(x, (int, float)) and math.isfinite(x) and x > 0 else 0.0


def recorded(trace: Trace) -> list[tuple[object, float]]:
    """(event, model seconds) for Start (prefill and routing: the run's time not spent in steps), then each Step."""
    step_s = [_seconds(s.draft_s) + _seconds(s.verify_s) + _seconds(s.overhead_s) for s in trace.steps]
    return [(trace.start, max(0.0, _seconds(trace.compute_s) - sum(step_s))), *zip(trace.steps, step_s)]


def pauses(times: list[float], speed, budget_s: float) -> list[float]:
    """The pause before each event: its recorded model time scaled by speed, each at most MAX_PAUSE_S, and
    all together at most budget_s (a long trace plays faster, never longer); no pauses at speed None."""
    if not speed:
        return [0.0] * len(times)
    out = [min(MAX_PAUSE_S, t / speed) for t in times]
    total = sum(out)
    return [p * budget_s / total for p in out] if total > budget_s else out


def _paced(events, waits, should_stop):
    """The events, each after its pause; ends early when should_stop() says so."""
    for ev_dt, wait in zip(events, waits):
        if should_stop():
            return
        if wait > 0:
            time.sleep(wait)
        yield ev_dt


def _problem(message: str, session) -> dict:
    return dict(session=session, tokens=vtok.stream_html("", placeholder=message, status="⚠ " + message))


def _load(studio: Studio, file, discard) -> Trace:
    """The trace in `file`: a path (tests, scripts: read as it is now), or the uploaded bytes the page sends.
    An upload is parsed once per content and then discarded (`discard(content)` deletes Gradio's copy, so
    the server keeps no visitor files); visitors who upload the same file meet the parsed copy in the
    studio's small LRU, bounded in count whatever their number."""
    if not isinstance(file, (bytes, bytearray)):
        return Trace.load(str(getattr(file, "name", file)))
    digest = hashlib.sha256(file).hexdigest()
    with studio.lock:
        trace = studio.uploads.get(digest)
        if trace is not None:
            studio.uploads.move_to_end(digest)
    if trace is None:
        try:
            trace = Trace.from_json(bytes(file))
        finally:
            if discard is not None:
                discard(bytes(file))
        with studio.lock:
            studio.uploads[digest] = trace
            while len(studio.uploads) > UPLOADS_KEPT:
                studio.uploads.popitem(last=False)
    elif discard is not None:
        discard(bytes(file))                # this visitor's copy of a file already read
    return trace


def replay(studio: Studio, session, file, speed_label: str = DEFAULT_SPEED, discard=None):
    """Load a trace and play it in the Generate view (and make it the Step-through's walk). It never runs the
    model, so app.py gives it a lane of its own: its pauses hold no one else's request."""
    studio, session = visitor(studio, session)
    if not file:
        yield _problem("Choose a trace file (.json) first: download one after any run with ⤓.", session)
        return
    lim = studio.limits
    try:
        trace = _load(studio, file, discard)
    except TraceError as exc:
        yield _problem(f"Cannot replay this file: {exc}", session)
        return
    except OSError as exc:
        yield _problem(f"Cannot read the file: {exc.strerror or exc}", session)
        return
    if len(trace.steps) > lim.replay_steps:
        yield _problem(f"This trace has {len(trace.steps):,} steps; this server replays at most "
                       f"{lim.replay_steps:,} (cap replay_steps).", session)
        return
    elsewhere = _recorded_elsewhere(studio, trace)
    run = Run(trace.prompt, trace.strategy, trace.config, replay=trace, foreign=elsewhere is not None)
    session.run, session.stop, session.race = run, False, None
    speed = SPEEDS.get(speed_label, 1.0)
    events = recorded(trace)
    asked = pauses([dt for _, dt in events], speed, float("inf"))
    waits = pauses([dt for _, dt in events], speed, lim.replay_s)
    note = (f"Replay of a {LABELS.get(trace.strategy, trace.strategy)} run recorded "
            f"{trace.meta.get('created', '')} · no model runs. "
            + (f"Recorded with {elsewhere}: the map and layer map are not shown. " if elsewhere else "")
            + (f"Played faster than asked: a replay lasts at most {lim.replay_s} s here. "
               if sum(waits) + 1e-9 < sum(asked) else ""))
    yield dict(session=session, walk=walk_view(studio, None), prompt=trace.prompt)
    for update in coalesce(show_events(studio, session, run, _paced(events, waits, lambda: session.stop), note,
                                       verb="replaying"), every_s=UPDATE_EVERY_S):
        yield dict(session=session, **update)
    session.race = _race(trace.meta.get("race"))
    cost, what_if_fig = cost_view(studio, run, session.race) if not run.foreign else (None, None)
    walk = walk_from_trace(trace, 1.0 if speed is None else speed)
    session.walk = walk
    out = dict(session=session, stats=stats_view(run, session.race, note),
               race=vstats.race_html(session.race), walk=walk_view(studio, walk),
               trace_file=trace_download(studio, session))
    if cost is not None:
        out.update(cost=cost, what_if=what_if_fig)
    yield out


def _recorded_elsewhere(studio: Studio, trace: Trace) -> str | None:
    """Why the map and layer map cannot show this trace (another model or calibration), or None."""
    bb, cal = studio.backbone, studio.calibration
    if trace.model != bb.name or tuple(trace.start.embedding.shape) != (bb.hidden,):
        return f"{trace.model}, not the loaded {bb.name}"
    route = trace.start.route
    if route is not None:
        r = cal.router if cal is not None else None
        same = r is not None and all(0 <= n.index < len(r.texts) and r.texts[n.index] == n.text
                                     and r.domains[n.index] == n.domain for n in route.neighbours)
        if not same:
            return "another calibration (its anchor prompts differ from the loaded one's)"
    return None


def _race(d) -> vstats.RaceResult | None:
    """The race result a trace kept, if it is well-formed (a hand-edited file may not be). Traces written
    before the near-tie check have no `tie_gap`."""
    numbers = ("ar_tokens_per_s", "tokens_per_s", "ar_tokens", "tokens")
    names = {f.name for f in dataclasses.fields(vstats.RaceResult)}
    if not isinstance(d, dict) or set(d) not in (names, names - {"tie_gap"}):
        return None
    gap = d.get("tie_gap")
    ok = (isinstance(d["strategy"], str) and d["identical"] in (True, False, None)
          and all(isinstance(d[k], (int, float)) and not isinstance(d[k], bool) and d[k] >= 0 for k in numbers)
          and (d["first_difference"] is None or isinstance(d["first_difference"], int))
          and (gap is None or (isinstance(gap, (int, float)) and not isinstance(gap, bool) and math.isfinite(gap))))
    return vstats.RaceResult(**d) if ok else None


def walk_from_trace(trace: Trace, speed: float = 1.0) -> Walk:
    """A Step-through over the trace's steps: the same phases as a live walk, with the trace's token texts."""
    walk = start_walk(trace.prompt, trace.start, trace.steps, replay=trace)
    walk.pause = min(MAX_PAUSE_S, 0.9 / max(speed, 0.1))
    return walk
