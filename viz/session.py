"""Per-browser-session state (Run, Walk, Session) and the views the handlers send, without Gradio.

Each view takes the shared Studio and this session's last run and returns HTML or a plotly figure.
"""
from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
from dataclasses import dataclass, field
from pathlib import Path

from ssd_core.engine.decode import DecodeConfig, Start
from ssd_core.engine.device import device_label
from ssd_core.engine.generate import summarize
from ssd_core.engine.trace import Trace, record
from ssd_core.engine.goodput import GoodputRule
from ssd_core.engine.rows import ALPHA_PRIOR
from viz import batch_view as vbatch
from viz import cost as vcost
from viz import domain_map as vmap
from viz import layers as vlayers
from viz import stats as vstats
from viz import tokens as vtok
from viz.studio import LABELS, MAP_H, PLOT_H, Studio, public_message


# --- per-session state ---------------------------------------------------------------------------
@dataclass
class Run:
    """One generation as it happened: the request, the events and the time spent decoding."""

    prompt: str
    strategy: str
    config: DecodeConfig
    start: Start | None = None
    steps: list = field(default_factory=list)
    compute_s: float = 0.0
    route: dict | None = None
    route_used: bool = False
    history: list = field(default_factory=list)      # [(step, SkipSet)] each time the set changed
    replay: object = None                             # the Trace being replayed, if this run is one
    foreign: bool = False                             # replayed from another model: no map, no layer map

    @property
    def token_ids(self) -> tuple[int, ...]:
        first = (self.start.first_token,) if self.start else ()
        return first + tuple(t for s in self.steps for t in s.committed)

    @property
    def stats(self):
        return summarize(self.start, self.steps, self.compute_s) if self.start else None

    @property
    def skip(self):
        return self.history[-1][1] if self.history else None


@dataclass
class Walk:
    """Step-through state: a finished run's steps, shown one phase per click. The steps are decoded at
    Start (or come from a trace), so a walk holds no live decode, no KV cache and no model time."""

    steps: tuple
    prompt: str
    skip_desc: str
    ids: list = field(default_factory=list)
    step: object | None = None
    phase: str = "draft"
    done: bool = False
    replay: object = None              # the Trace it walks, if it replays one (its token texts are used)
    pause: float = 0.9                 # auto-play: seconds between phases
    next_index: int = 0                # the next of `steps` to show


@dataclass
class Session:
    run: Run | None = None
    race: vstats.RaceResult | None = None
    walk: Walk | None = None
    stop: bool = False
    example_turn: dict = field(default_factory=dict)
    map_whole: bool = False          # the domain map's toggle: whole map instead of the prompt's neighbourhood
    calibration: str | None = None   # the calibration this visitor picked (Studio.choices); None: the served one


def vocab(studio: Studio, run: Run):
    """(id → text, end-of-text ids) for a run: a replay's own, else the loaded model's."""
    if run.replay is not None:
        return run.replay.token_str, frozenset(run.replay.eos)
    return studio.backbone.token_str, studio.backbone.eos_ids


# --- traces: a run kept as a file, on the visitor's machine only -------------------------------------------
def trace_of(studio: Studio, session) -> Trace | None:
    """The session's last run as a Trace (a replay keeps its own), or None when there is no run to keep."""
    run = session.run
    if run is None or run.start is None:
        return None
    return run.replay or record(
        studio.backbone, run.prompt, run.strategy, run.config, run.start, run.steps, run.compute_s,
        created=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), app="KNN-SSD Studio",
        device=device_label(studio.backbone.device),
        calibration=Path(studio.cal_folder).name if studio.calibration is not None else None,   # no server paths
        stopped=bool(session.stop),
        race=dataclasses.asdict(session.race) if session.race is not None else None)


DOWNLOAD_LABEL = "⤓ Download this run (trace .json)"
NO_TRACE = f'<span class="trace-link off" aria-disabled="true">{DOWNLOAD_LABEL}</span>'   # before a run ends


def trace_download(studio: Studio, session) -> str:
    """The download link after a run. The trace travels inside the link (a data: URL, ~50 KB for 96 tokens),
    so the server writes no file and keeps nothing once the visitor leaves; without a run, a dimmed label."""
    trace = trace_of(studio, session)
    if trace is None:
        return NO_TRACE
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    payload = base64.b64encode(trace.to_json().encode("utf-8")).decode("ascii")
    return (f'<a class="trace-link" download="knn-ssd-trace-{trace.strategy}-{stamp}.json" '
            f'href="data:application/json;base64,{payload}">{DOWNLOAD_LABEL}</a>')


def get_session(s) -> Session:
    return s if isinstance(s, Session) else Session()


def visitor(studio: Studio, s) -> tuple[Studio, Session]:
    """(the studio as this visitor sees it — the calibration they picked —, their session)."""
    session = get_session(s)
    return studio.for_visitor(session.calibration), session


def domains_views(studio: Studio):
    """The Domains & layer sets tab: a sentence, every domain's set, the matchness heatmap."""
    cal = studio.calibration
    if cal is None:
        return "No calibration yet: run it from the banner at the top.", None, None
    acc = cal.routing.get(cal.routing.get("used", "user"), {}).get("accuracy", {}).get("overall")
    outside = cal.routing.get("check_set")
    text = ("Each domain gets its own skip set, searched offline. "
            + (f"Held-out routing accuracy of the KNN router: **{acc:.0%}**; " if acc is not None else "")
            + (f"on {outside['prompts']} prompts written after the anchors (assets/routing_check): "
               f"**{outside['accuracy']['overall']:.0%}**; " if outside else "")
            + f"prompts less similar than {cal.router.threshold:.2f} to every anchor count as unknown → static set."
            + "\n\n" + vlayers.domain_check_md(cal.meta.get("check"), cal.meta["settings"].get("check_margin"),
                                                cal.meta["settings"].get("search_mode"),
                                                cal.meta["settings"].get("lookup_aware", False)))
    return (text, vlayers.sets_grid(studio.backbone.n_layers, cal.domain_sets, cal.static),
            vlayers.matchness_heatmap(cal.matchness, list(cal.domain_sets)))


# --- view helpers ----------------------------------------------------------------------------------
def tokens_view(studio: Studio, parts: list[str], status: str = "") -> str:
    return vtok.stream_html("".join(parts), placeholder="The answer streams here, token by token.",
                            status=status)


def layer_fig(studio: Studio, run: Run | None):
    cal = studio.calibration
    sets = cal.domain_sets if cal else {}
    static = cal.static if cal else None
    n = studio.backbone.n_layers
    if run is None or run.skip is None or run.foreign:
        return vlayers.layer_map(n, sets, static, height=PLOT_H)
    route = run.route or {}
    domain = {"knn": (route.get("domain") or "static") if run.route_used else None,
              "static": "static", "oracle": run.skip.name, "knapspec": "knapspec"}.get(run.strategy)
    name = {"knn": f"{domain} set", "static": "static set", "oracle": f"{run.skip.name} set",
            "knapspec": "KnapSpec set"}.get(run.strategy, run.skip.name)
    return vlayers.layer_map(n, sets, static, in_use=run.skip, in_use_name=name, in_use_domain=domain,
                             history=run.history, height=PLOT_H, draft=run.start.draft if run.start else "")


def map_fig(studio: Studio, run: Run | None, whole: bool = False):
    """The domain map; after a run zoomed to the prompt's neighbourhood unless `whole`."""
    if studio.domain_map is None:          # the title is public: a map error's words pass public_message
        return vmap.domain_map([], height=MAP_H, title="Domain map · " + (
            "needs a calibration" if studio.calibration is None else (public_message(studio.map_error)
                                                                      or "unavailable")))
    if run is None or run.start is None or run.foreign:
        return vmap.domain_map(studio.anchors, studio.domain_map.coords, height=MAP_H)
    xy = studio.domain_map.transform(studio.calibration.router.query(run.start.embedding))
    return vmap.domain_map(studio.anchors, studio.domain_map.coords, xy, run.route, run.prompt, height=MAP_H,
                           whole=whole)


def route_view(run: Run | None, static=None) -> str:
    """The route line; static: the calibration's static set, to say when the routed draft is that set."""
    if run is None:
        return vmap.route_html(None)
    if run.route is None:
        return vmap.route_html(None, run.strategy)
    same = run.route_used and static is not None and run.skip is not None and run.skip.same_draft(static)
    return vmap.route_html(run.route, run.strategy, used=run.route_used, same_as_static=same)


def cost_view(studio: Studio, run: Run | None, race: vstats.RaceResult | None):
    """The cost panel and what-if chart for the last run (or the static set before any run)."""
    cal = studio.calibration
    if cal is None:
        return ('<div class="cost">The cost panel needs a calibration (its latency model).</div>',
                vcost.what_if_figure(4, 0.8, 1.3))
    lat = cal.latency
    skip = run.skip if run is not None and run.skip is not None else cal.static
    gamma = run.config.gamma if run is not None else 4
    stats = run.stats if run is not None else None
    kind = run.config.draft if run is not None else "int8"
    kind = kind if lat.knows(kind) else "fp32"
    if stats is not None and stats.drafted:
        alpha, source = stats.alpha, "this run"
    else:
        acc = cal.acceptance(kind)
        alpha, source = acc.get(skip.name, acc["static"]), "calibration"
    ctx = (run.start.prompt_len + stats.new_tokens // 2) if run is not None and run.start else 256
    b = lat.breakdown(skip, alpha, gamma, ctx, kind)
    measured_speedup, measured = None, {}
    race = race if race is not None and race.against == "autoregressive" else None   # vs static: no AR time
    if race is not None and run is not None and race.strategy == LABELS.get(run.strategy):
        measured_speedup, measured = race.speedup, race.costs or {}
    steps = run.steps if run is not None else []
    run_pred = lat.predicted_run_speedup(steps, kind) if any(s.speculative for s in steps) else None
    label = LABELS.get(run.strategy, "static set") if run is not None else "static set (no run yet)"
    html = vcost.cost_html(b, strategy=label, skip_name=skip.name or "chosen", alpha=alpha,
                           tau=stats.tau if stats is not None and stats.drafted else None,
                           measured_speedup=measured_speedup, measured=measured, alpha_source=source,
                           profiled_on=lat.device_words, runs_on=device_label(studio.backbone.device),
                           run_prediction=run_pred, run_steps=steps, provisional=lat.provisional)
    c_big = 1.0 - studio.backbone.skip_weight_ratio(skip)
    star, label = acceptance_star(stats, gamma, alpha)
    here = "this CPU" if lat.device.startswith("cpu") else "this GPU" if lat.device.startswith("cuda") else lat.device
    return html, vcost.what_if_figure(gamma, b["draft_cost"], b["verify_cost"], star, c_big=c_big, label=label,
                                      here=here)


def batch_view(studio: Studio, run: Run | None):
    """The cost panel's batch figure: the goodput rule's predicted speedup over plain batched decoding as the
    number of visitors grows, at this run's α, γ and draft (else the calibration's static set), and where the
    run's steps were. The serving engine's rule and costs when one serves, else the rule's built-in costs."""
    cal, bb = studio.calibration, studio.backbone
    engine = getattr(studio, "engine", None)
    rule = getattr(engine, "rule", None) or GoodputRule(bb)
    stats = run.stats if run is not None else None
    skip = run.skip if run is not None and run.skip is not None else (cal.static if cal is not None else None)
    if stats is not None and stats.drafted:
        alpha, source = stats.alpha, "this run"
    elif cal is not None:
        kind = run.config.draft if run is not None else "int8"
        acc = cal.acceptance(kind if cal.latency.knows(kind) else "fp32")
        alpha, source = acc.get(skip.name, acc["static"]), "calibration"
    else:
        alpha, source = ALPHA_PRIOR, "the engine's prior"
    gamma = run.config.gamma if run is not None else 4
    ratio = 1.0 - bb.skip_weight_ratio(skip) if skip is not None else 1.0
    most = getattr(engine, "max_rows", None) or studio.limits.max_rows
    curve = rule.curve(alpha, gamma, ratio, rows=range(1, max(2, most) + 1))
    steps = run.steps if run is not None else []
    here = sum(s.rows for s in steps) / len(steps) if steps else None
    return vbatch.batch_figure(curve, gamma, alpha, ratio, rows_here=here, provisional=rule.costs.provisional,
                               alpha_source=source)


def acceptance_star(stats, gamma: int, alpha: float) -> tuple[float, str]:
    """Where the run sits on the what-if map: the acceptance that explains its measured τ."""
    if stats is not None and stats.drafted:
        return vcost.effective_acceptance(stats.tau, gamma), f"this run (τ {stats.tau:.2f})"
    return alpha, "calibration"


def stats_view(run: Run | None, race, note: str = "") -> str:
    if run is None:
        return vstats.stats_html(None)
    return vstats.stats_html(run.stats, race=race, speculative=run.strategy != "ar", note=note,
                             steps=run.steps, gamma=run.config.gamma)



def header_html(studio: Studio) -> str:
    d = studio.backbone.describe()
    return ('<div class="app-header"><div class="app-title"><b>KNN-SSD Studio</b> · self-speculative decoding, '
            f'visualised</div><div class="app-model">model: <b>{vtok.escape(d["model"])}</b> · {d["n_layers"]} '
            f'layers · {d["params_m"]}M parameters · {vtok.escape(_device_words(d["device"]))}</div>'
            '<div class="app-explainer">The model drafts tokens with a cheaper copy of itself (int8, layers '
            "skipped) or copies earlier text, then checks them in one full pass: the text stays exactly what "
            "plain decoding writes.</div></div>")




def _device_words(label: str) -> str:
    """engine.device.device_label for the header: "CPU (2 threads)", "CUDA: NVIDIA H100 …"."""
    kind, sep, rest = label.partition(" ")
    return kind.upper() + sep + rest


def banner(text: str, ok: bool = False) -> str:
    return f'<div class="banner {"ok" if ok else "warn"}">{vtok.escape(text)}</div>'
