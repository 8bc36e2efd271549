"""KNN-SSD Studio — the Gradio app: self-speculative decoding, visualised.

    python app.py [--model SPEC] [--calibration DIR]

ssd_core produces the events (Start, Step), viz/ turns them into HTML and plotly figures, and this
file only wires the two: shared read-only resources (Studio), per-browser-session state (Session),
event handlers as plain generator functions, and the Blocks layout.
"""
from __future__ import annotations

import os
import time
import unicodedata

T_LAUNCH = time.perf_counter()     # start-up is timed from here: what someone running `python app.py` waits

# OpenMP's wait policy is left at its default (spin briefly, then sleep): on two cores of its own,
# sleeping threads made every small matmul pay a wake-up, and the int8 draft step took 34 ms instead
# of 16 ms. On a CPU shared with other heavy jobs, set OMP_WAIT_POLICY=PASSIVE before starting.
# numba (UMAP) would otherwise load a second OpenMP runtime beside torch's, in a thread that runs while
# torch decodes at start-up; its own work-queue layer is enough for placing one point at a time.
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

import argparse
import html
import json
import logging
import threading
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import gradio as gr

from ssd_core import calibration as cal_io
from ssd_core.calibration.domains import DOMAINS, load_prompts, split
from ssd_core.engine.decode import DecodeConfig, Start, decode
from ssd_core.engine.generate import generate as core_generate
from ssd_core.engine.generate import summarize
from ssd_core.engine.loading import load_backbone
from ssd_core.engine.skipset import SkipSet
from ssd_core.policies.ar import Autoregressive
from viz import benchmark as vbench
from viz import cost as vcost
from viz import domain_map as vmap
from viz import layers as vlayers
from viz import stats as vstats
from viz import stepthrough as vwalk
from viz import tokens as vtok
from viz.theme import css_variables

log = logging.getLogger("knn-ssd-studio")
ROOT = Path(__file__).resolve().parent
BENCH_DIR = ROOT / "assets" / "bench"
STRATEGIES = {"KNN-SSD": "knn", "static set": "static", "KnapSpec": "knapspec", "oracle": "oracle",
              "autoregressive": "ar"}
LABELS = {v: k for k, v in STRATEGIES.items()}
MAX_PROMPT_TOKENS = 1024        # longer prompts are shortened (head + tail) with a visible notice
MAX_PROMPT_CHARS = 100_000      # request size limit: beyond this we refuse instead of tokenising
MAX_NEW_TOKENS = 512
QUEUE_SIZE = 64                 # waiting requests beyond this are turned away by gradio's queue
# Models a public Space may serve (never arbitrary paths, never trust_remote_code).
ALLOWED_MODELS = (None, "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct",
                  "Qwen/Qwen2.5-0.5B-Instruct")
# the draft's weights, as offered in the UI: (DecodeConfig.draft, DecodeConfig.lookup)
DRAFTS = {"int8 + prompt lookup": ("int8", True), "int8": ("int8", False),
          "fp32 + prompt lookup": ("fp32", True), "fp32 (layer skipping only)": ("fp32", False)}
DEFAULT_DRAFT = "int8 + prompt lookup"
PLOT_H = 270                  # the two Generate-tab figures; with the rest it fits 1280×720
QUICK_CALIBRATION = dict(budget=8, prompts_per_domain=4, held_out_per_domain=3)
SKIP = gr.skip


# --- shared, read-mostly resources (one per process) --------------------------------------------
@dataclass
class Studio:
    """What every session shares: the model, its calibration and the pre-built figures."""

    backbone: object
    spec: str | None
    cal_folder: Path
    examples: dict[str, list[str]]
    bench: dict
    calibration: object | None = None
    cal_error: str = ""
    domain_map: object | None = None
    anchors: list = field(default_factory=list)
    map_error: str = ""
    timings: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def install(self, cal, domain_map=None, map_error: str = "") -> None:
        """Swap in a (new) calibration and its domain map for every session."""
        anchors = []
        if domain_map is not None:
            r = cal.router
            anchors = vmap.anchor_traces(domain_map.coords, r.domains, r.texts, r.kinds)
        with self.lock:
            self.calibration, self.cal_error = cal, ""
            self.domain_map, self.anchors, self.map_error = domain_map, anchors, map_error


def _load_map(cal) -> tuple[object | None, str]:
    try:
        dm = cal.load_domain_map()
        dm.warm()
        return dm, ""
    except Exception as exc:        # umap unusable or file changed: the app works without the map
        return None, f"domain map unavailable: {exc}"


def load_studio(spec: str | None = None, calibration: str | Path | None = None, threads: int = 2,
                warm: bool = True, backbone=None, map_in_background: bool = False) -> Studio:
    """Load model and calibration; the UMAP domain map is not needed for the first token.

    map_in_background: return before the map is ready (umap's first import compiles with numba for
    ~15 s on two cores); a thread installs it when done and the map panel says "loading" until then.
    """
    t0 = time.perf_counter()
    folder = Path(calibration) if calibration else cal_io.default_folder(spec)
    from ssd_core.engine import loading as core_bb
    cold = backbone is None and not core_bb.model_cache_ready(spec)
    bb = backbone or load_backbone(spec, threads=threads)
    t_model = time.perf_counter() - t0
    prompts = load_prompts()
    examples = {d: split(p)[1] or p for d, p in prompts.items()}
    studio = Studio(bb, spec, folder, examples, read_bench(BENCH_DIR))
    try:
        cal = cal_io.load(folder, bb)
        studio.install(cal, None, "domain map loading …")
    except cal_io.CalibrationError as exc:
        cal = None
        studio.cal_error = public_message(str(exc))
    if warm:                       # one short decode, so a visitor's first click pays no first-call costs
        warm_up(studio)
    studio.timings = {"cold": cold, "model_s": round(t_model, 1),
                      "ready_s": round(time.perf_counter() - t0, 1), "map_s": None}

    def prepare_map():
        t = time.perf_counter()
        dm, err = _load_map(cal)
        if studio.calibration is cal:      # not replaced by a calibration run meanwhile
            studio.install(cal, dm, err)
        studio.timings["map_s"] = round(time.perf_counter() - t, 1)

    if cal is not None:
        if map_in_background:
            threading.Thread(target=prepare_map, name="domain-map", daemon=True).start()
        else:
            prepare_map()
    return studio


def warm_up(studio: Studio) -> None:
    """One short decode and one of each figure, so a visitor's first click pays no first-call costs."""
    prompt = next(iter(studio.examples.values()))[0]
    for _ in generate(studio, None, prompt, "KNN-SSD", None, 6, 3, 0.0, 0.0, 1.0, 5):
        pass


def read_bench(folder: Path) -> dict:
    """Whatever benchmark results are committed under assets/bench/ (nothing → empty entries)."""
    out = {"summary": None, "summary_path": "", "answers": {}, "core": None, "scaling": None, "markdown": []}
    for path in sorted(folder.glob("*/summary.json")):
        summary = _read_json(path)
        if summary:
            out["summary"], out["summary_path"] = summary, _rel(path)
            out["answers"] = {p.stem: a for p in sorted(path.parent.glob("*.jsonl")) if (a := _answers(p))}
            break
    out["core"] = _read_json(folder / "core.json")
    out["scaling"] = next((s for p in sorted(folder.glob("**/scaling.json")) if (s := _read_json(p))), None)
    out["markdown"] = [(_rel(p), p.read_text(encoding="utf-8")) for p in sorted(folder.glob("**/*.md"))]
    return out


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _answers(path: Path) -> list:
    """Spec-Bench answer records (one JSON object a line with `choices`), or [] for other files."""
    try:
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
    return rows if rows and all(isinstance(r, dict) and "choices" in r for r in rows) else []


def bench_plots(bench: dict) -> list:
    """The bench's own figures (viz.bench_figures), for whatever results exist."""
    try:
        from viz import bench_figures as bf
        figs = []
        if bench["summary"]:
            figs += [bf.speedup_figure(bench["summary"]), bf.tau_figure(bench["summary"])]
        if bench["answers"]:
            figs.append(bf.accept_length_figure(bench["answers"]))
        if bench["scaling"]:
            figs.append(bf.scaling_figure(bench["scaling"]))
        return figs
    except Exception as exc:      # results written by another version: show the tables, log the rest
        log.warning("benchmark figures unavailable: %s", exc)
        return []


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


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
    """Step-through state: a live decode advanced one step per click."""

    events: object
    prompt: str
    skip_desc: str
    ids: list = field(default_factory=list)
    step: object | None = None
    phase: str = "draft"
    done: bool = False


@dataclass
class Session:
    run: Run | None = None
    race: vstats.RaceResult | None = None
    walk: Walk | None = None
    stop: bool = False
    example_turn: dict = field(default_factory=dict)


def _session(s) -> Session:
    return s if isinstance(s, Session) else Session()


def page_load(studio: "Studio", built_with, session):
    """On page load: this visitor's own state (which also opens the event stream before the first
    click) and, if a calibration was installed after the layout was built, everything that shows it."""
    session = _session(session)
    cal = studio.calibration
    if cal is built_with:
        # the UMAP may have finished loading in the background since the layout was built
        return (session, *[SKIP()] * 4, _map_fig(studio, None) if studio.domain_map is not None else SKIP(),
                *[SKIP()] * 6)
    text, sets, match = domains_views(studio)
    cost, what_if_fig = _cost_view(studio, None, None)
    return (session, gr.update(visible=cal is None), SKIP(), gr.update(value="KNN-SSD" if cal else "autoregressive"),
            gr.update(value=cal.router.k) if cal else SKIP(), _map_fig(studio, None), _layer_fig(studio, None),
            cost, what_if_fig, text, gr.update(value=sets, visible=cal is not None),
            gr.update(value=match, visible=cal is not None))


def domains_views(studio: "Studio"):
    """The Domains & layer sets tab: a sentence, every domain's set, the matchness heatmap."""
    cal = studio.calibration
    if cal is None:
        return "No calibration yet: run it from the banner at the top.", None, None
    acc = cal.routing.get("user", {}).get("accuracy", {}).get("overall")
    outside = cal.routing.get("check_set")
    text = ("Each domain gets its own skip set, searched offline. "
            + (f"Held-out routing accuracy of the KNN router: **{acc:.0%}**; " if acc is not None else "")
            + (f"on {outside['prompts']} prompts written after the anchors (assets/routing_check): "
               f"**{outside['accuracy']['overall']:.0%}**; " if outside else "")
            + f"prompts less similar than {cal.router.threshold:.2f} to every anchor count as unknown → static set."
            + "\n\n" + vlayers.domain_check_md(cal.meta.get("check"), cal.meta["settings"].get("check_margin"),
                                                cal.meta["settings"].get("search_mode")))
    return (text, vlayers.sets_grid(studio.backbone.n_layers, cal.domain_sets, cal.static),
            vlayers.matchness_heatmap(cal.matchness, list(cal.domain_sets)))


# --- building a request -----------------------------------------------------------------------------
def make_config(max_new, gamma, threshold, temperature, top_p, draft=DEFAULT_DRAFT) -> DecodeConfig:
    """Settings from the UI or the API; anything out of range raises ValueError with a message."""
    if not 1 <= float(max_new) <= MAX_NEW_TOKENS:
        raise ValueError(f"max new tokens must be between 1 and {MAX_NEW_TOKENS}")
    if draft not in DRAFTS:
        raise ValueError(f"draft must be one of: {', '.join(DRAFTS)}")
    kind, lookup = DRAFTS[draft]
    return DecodeConfig(max_new_tokens=int(max_new), gamma=int(gamma), threshold=float(threshold),
                        temperature=float(temperature), top_p=float(top_p), seed=0,
                        max_prompt_tokens=MAX_PROMPT_TOKENS, draft=kind, lookup=lookup)


def safe_k(k) -> int:
    """K, the number of neighbours the router votes with: a whole number in 1..50."""
    if not 1 <= float(k) <= 50:
        raise ValueError("K (neighbours) must be between 1 and 50")
    return int(k)


def make_strategy(studio: Studio, name: str, gamma: int, k: int, domain: str | None, draft: str = "int8"):
    cal = studio.calibration
    if cal is None or name == "ar":
        return Autoregressive()
    return cal.strategy(name, gamma=int(gamma), k=int(k), domain=domain or None, draft=draft)


def _timed(events):
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
    if route is None and cal is not None:   # show where KNN *would* send it, marked as not used
        route = cal.router.route(start.embedding).to_dict()
    skip = start.skip if run.strategy != "ar" else None
    return route, used, skip


# --- view helpers ----------------------------------------------------------------------------------
def _tokens_view(studio: Studio, parts: list[str], status: str = "") -> str:
    return vtok.stream_html("".join(parts), placeholder="The answer streams here, token by token.",
                            status=status)


def _layer_fig(studio: Studio, run: Run | None):
    cal = studio.calibration
    sets = cal.domain_sets if cal else {}
    static = cal.static if cal else None
    n = studio.backbone.n_layers
    if run is None or run.skip is None:
        return vlayers.layer_map(n, sets, static, height=PLOT_H)
    route = run.route or {}
    domain = {"knn": (route.get("domain") or "static") if run.route_used else None,
              "static": "static", "oracle": run.skip.name, "knapspec": "knapspec"}.get(run.strategy)
    name = {"knn": f"{domain} set", "static": "static set", "oracle": f"{run.skip.name} set",
            "knapspec": "KnapSpec set"}.get(run.strategy, run.skip.name)
    return vlayers.layer_map(n, sets, static, in_use=run.skip, in_use_name=name, in_use_domain=domain,
                             history=run.history, height=PLOT_H, draft=run.start.draft if run.start else "")


def _map_fig(studio: Studio, run: Run | None):
    if studio.domain_map is None:
        return vmap.domain_map([], height=PLOT_H, title="Domain map · " + (
            "needs a calibration" if studio.calibration is None else (studio.map_error or "unavailable")))
    if run is None or run.start is None:
        return vmap.domain_map(studio.anchors, studio.domain_map.coords, height=PLOT_H)
    xy = studio.domain_map.transform(run.start.embedding)
    return vmap.domain_map(studio.anchors, studio.domain_map.coords, xy, run.route, run.prompt, height=PLOT_H)


def _route_view(run: Run | None) -> str:
    if run is None:
        return vmap.route_html(None)
    if run.route is None:
        return vmap.route_html(None, run.strategy)
    return vmap.route_html(run.route, run.strategy, used=run.route_used)


def _cost_view(studio: Studio, run: Run | None, race: vstats.RaceResult | None):
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
    measured_speedup = None
    if race is not None and run is not None and race.strategy == LABELS.get(run.strategy):
        measured_speedup = race.speedup
    full_s = (1.0 / race.ar_tokens_per_s) if race is not None and race.ar_tokens_per_s else lat.step_time(
        SkipSet.empty(), ctx)
    measured = vcost.measured_costs(run.steps, full_s) if run is not None else {}
    label = LABELS.get(run.strategy, "static set") if run is not None else "static set (no run yet)"
    html = vcost.cost_html(b, strategy=label, skip_name=skip.name or "chosen", alpha=alpha,
                           tau=stats.tau if stats is not None and stats.drafted else None,
                           measured_speedup=measured_speedup, measured=measured, alpha_source=source)
    c_big = 1.0 - studio.backbone.skip_weight_ratio(skip)
    star, label = _star(stats, gamma, alpha)
    return html, vcost.what_if_figure(gamma, b["draft_cost"], b["verify_cost"], star, c_big=c_big, label=label)


def _star(stats, gamma: int, alpha: float) -> tuple[float, str]:
    """Where the run sits on the what-if map: the acceptance that explains its measured τ."""
    if stats is not None and stats.drafted:
        return vcost.effective_acceptance(stats.tau, gamma), f"this run (τ {stats.tau:.2f})"
    return alpha, "calibration"


# --- handlers: Generate ------------------------------------------------------------------------------
GEN_OUTPUTS = ("session", "tokens", "stats", "route", "domain_plot", "layer_plot", "race", "cost",
               "what_if")


def _out(**changes):
    """A tuple in GEN_OUTPUTS order; outputs not named are left as they are (gr.skip())."""
    return tuple(changes[k] if k in changes else SKIP() for k in GEN_OUTPUTS)


def public_message(text: str) -> str:
    """A message fit for a public page: no absolute file-system paths."""
    text = text.replace(str(ROOT) + "/", "").replace(str(ROOT), ".")
    return text.replace(str(Path.home()), "~")


def generate_text(studio: "Studio", prompt: str, strategy: str = "KNN-SSD", max_new_tokens: float = 64,
                  gamma: float = 4, threshold: float = 0.0, temperature: float = 0.0,
                  top_p: float = 1.0, draft: str = DEFAULT_DRAFT) -> dict:
    """The plain API: one whole answer and its stats (gradio_client, the soak script and tests).

    Bad input never raises: the answer is {"error": message} and the server keeps serving.
    """
    err, cfg = _problem(prompt, lambda: make_config(max_new_tokens, gamma, threshold, temperature, top_p, draft))
    if err:
        return {"error": err}
    name = STRATEGIES.get(strategy, strategy if strategy in STRATEGIES.values() else None)
    if name is None:
        return {"error": f"unknown strategy {str(strategy)[:40]!r}; choose from {', '.join(STRATEGIES)}"}
    if studio.calibration is None:
        name = "ar"
    g = core_generate(studio.backbone, clean_prompt(prompt).strip(),
                      make_strategy(studio, name, cfg.gamma, 5, None, cfg.draft), cfg)
    st = g.stats
    return {"text": g.text, "strategy": name, "new_tokens": st.new_tokens, "tau": round(st.tau, 3),
            "alpha": round(st.alpha, 3), "tokens_per_s": round(st.tokens_per_s, 2),
            "truncated": g.start.truncated, "domain": g.start.domain}


def clean_prompt(prompt) -> str:
    """Drop control characters (keeping newlines and tabs); emoji, RTL and CJK text pass as they are."""
    if not isinstance(prompt, str):
        return ""
    return "".join(c for c in prompt if c in "\n\t" or unicodedata.category(c) not in ("Cc", "Cs"))


def _problem(prompt: str, make) -> tuple[str, object]:
    """(error message, value): a bad prompt or setting becomes a message, never a traceback."""
    prompt = clean_prompt(prompt)
    if not clean_prompt(prompt).strip():
        return "Type a prompt first (or click an example).", None
    if len(prompt) > MAX_PROMPT_CHARS:
        return (f"That prompt has {len(prompt):,} characters; the limit is {MAX_PROMPT_CHARS:,}. "
                "Please shorten it."), None
    try:
        return "", make()
    except (ValueError, TypeError, OverflowError) as exc:
        return f"Setting not accepted: {exc}", None


def _stream(studio: Studio, session: Session, prompt: str, strategy: str, domain, cfg: DecodeConfig, k: int):
    """Decode and yield view updates (dicts); the finished Run is left in session.run."""
    cal_note = ""
    if studio.calibration is None and strategy != "ar":
        cal_note = "No calibration for this model yet, so this runs autoregressively. "
        strategy = "ar"
    run = Run(prompt, strategy, cfg)
    session.run, session.stop = run, False
    strat = make_strategy(studio, strategy, cfg.gamma, k, domain, cfg.draft)
    bb = studio.backbone
    eos = bb.eos_ids
    parts: list[str] = []
    events = _timed(decode(bb, prompt, strat, cfg, should_stop=lambda: session.stop))
    for ev, dt in events:
        run.compute_s += dt
        if isinstance(ev, Start):
            run.start = ev
            run.route, run.route_used, skip = _in_use(studio, run, ev)
            if skip is not None:
                run.history.append((0, skip))
            parts.append(vtok.tokens_html(vtok.start_tokens(ev.first_token, bb.token_str, eos)))
            note = cal_note + ("The prompt was shortened to fit. " if ev.truncated else "")
            yield dict(tokens=_tokens_view(studio, parts, "generating…"),
                       stats=_stats_view(run, None, note), route=_route_view(run))
            yield dict(domain_plot=_map_fig(studio, run), layer_plot=_layer_fig(studio, run))
            continue
        run.steps.append(ev)
        update = {}
        if ev.skip is not None and (run.skip is None or ev.skip != run.skip):
            run.history.append((ev.index + 1, ev.skip))
            update["layer_plot"] = _layer_fig(studio, run)
        parts.append(vtok.tokens_html(vtok.step_tokens(ev, bb.token_str, eos)))
        update.update(tokens=_tokens_view(studio, parts, "generating…"),
                      stats=_stats_view(run, None, cal_note))
        yield update
    stopped = session.stop
    st = run.stats
    done = (f"stopped after {st.new_tokens} tokens" if stopped else
            f"done · {st.new_tokens} tokens in {len(run.steps)} steps · {st.wall_s:.2f} s model time")
    done += " · hover a token for its step, draft probability and the verifier's choice"
    yield dict(tokens=_tokens_view(studio, parts, done))


def _stats_view(run: Run | None, race, note: str = "") -> str:
    if run is None:
        return vstats.stats_html(None)
    return vstats.stats_html(run.stats, race=race, speculative=run.strategy != "ar", note=note,
                             steps=run.steps, gamma=run.config.gamma)


def generate(studio: Studio, session, prompt, strategy_label, domain, max_new, gamma, threshold,
             temperature, top_p, k, draft=DEFAULT_DRAFT):
    """Generate: stream coloured tokens, stats and (when they change) the two figures."""
    session = _session(session)
    err, got = _problem(prompt, lambda: (make_config(max_new, gamma, threshold, temperature, top_p, draft),
                                         safe_k(k)))
    if err:
        yield _out(session=session, tokens=vtok.stream_html("", placeholder=err, status="⚠ " + err))
        return
    cfg, k = got
    strategy = STRATEGIES.get(strategy_label, "knn")
    session.race = None
    for update in _stream(studio, session, clean_prompt(prompt).strip(), strategy, domain, cfg, int(k)):
        yield _out(session=session, **update)
    cost, what_if = _cost_view(studio, session.run, None)
    yield _out(session=session, cost=cost, what_if=what_if,
               race=vstats.race_html(None), stats=_final_stats(session))


def _final_stats(session: Session) -> str:
    return _stats_view(session.run, session.race)


def race(studio: Studio, session, prompt, strategy_label, domain, max_new, gamma, threshold,
         temperature, top_p, k, draft=DEFAULT_DRAFT):
    """Race: the chosen strategy (streamed) then autoregressive on the same prompt; speeds + lossless check."""
    session = _session(session)
    err, got = _problem(prompt, lambda: (make_config(max_new, gamma, threshold, temperature, top_p, draft),
                                         safe_k(k)))
    if err:
        yield _out(session=session, tokens=vtok.stream_html("", placeholder=err, status="⚠ " + err))
        return
    cfg, k = got
    strategy = STRATEGIES.get(strategy_label, "knn")
    if strategy == "ar":
        strategy = "knn" if studio.calibration is not None else "ar"
    session.race = None
    yield _out(session=session, race=vstats.race_html(None, running=f"1/2 · {LABELS[strategy]} running…"))
    for update in _stream(studio, session, clean_prompt(prompt).strip(), strategy, domain, cfg, int(k)):
        yield _out(session=session, **update)
    run = session.run
    if session.stop:
        yield _out(session=session, race=vstats.race_html(None, running="race stopped"))
        return
    yield _out(session=session, race=vstats.race_html(None, running="2/2 · autoregressive running…"))
    ar_ids, ar_time = [], 0.0
    for ev, dt in _timed(decode(studio.backbone, clean_prompt(prompt).strip(), Autoregressive(), cfg, should_stop=lambda: session.stop)):
        ar_time += dt
        ar_ids.extend([ev.first_token] if isinstance(ev, Start) else ev.committed)
        if len(ar_ids) % 16 == 0:
            yield _out(session=session, race=vstats.race_html(
                None, running=f"2/2 · autoregressive: {len(ar_ids)} of ≤ {cfg.max_new_tokens} tokens"))
    if session.stop:
        yield _out(session=session, race=vstats.race_html(None, running="race stopped"))
        return
    ids = run.token_ids
    same = tuple(ar_ids) == ids
    first_diff = None if same else next((i for i, (a, b) in enumerate(zip(ar_ids, ids)) if a != b),
                                        min(len(ar_ids), len(ids)))
    session.race = vstats.RaceResult(
        strategy=LABELS[run.strategy], ar_tokens_per_s=len(ar_ids) / ar_time if ar_time else 0.0,
        tokens_per_s=run.stats.tokens_per_s, ar_tokens=len(ar_ids), tokens=len(ids),
        identical=same if cfg.greedy else None, first_difference=first_diff)
    cost, what_if = _cost_view(studio, run, session.race)
    yield _out(session=session, race=vstats.race_html(session.race), stats=_final_stats(session),
               cost=cost, what_if=what_if)


def stop(studio: Studio, session):
    """Stop: the running decode ends at its next step (Gradio also cancels the event); show where."""
    session = _session(session)
    session.stop = True
    run = session.run
    if run is None or run.start is None:
        return session, SKIP(), SKIP()
    bb = studio.backbone
    parts = [vtok.tokens_html(vtok.start_tokens(run.start.first_token, bb.token_str, bb.eos_ids))]
    parts += [vtok.tokens_html(vtok.step_tokens(s, bb.token_str, bb.eos_ids)) for s in list(run.steps)]
    status = f"stopped after {run.stats.new_tokens} tokens"
    return session, _tokens_view(studio, parts, status), _stats_view(run, None)


def stop_walk(session):
    session = _session(session)
    session.stop = True
    return session


def pick_example(studio: Studio, session, domain: str):
    """An example button: the next held-out prompt of that domain (cycling), and the oracle's domain."""
    session = _session(session)
    prompts = studio.examples.get(domain) or [""]
    i = session.example_turn.get(domain, 0)
    session.example_turn[domain] = i + 1
    return session, prompts[i % len(prompts)], domain


def strategy_changed(strategy_label):
    return gr.update(visible=STRATEGIES.get(strategy_label) == "oracle")


def what_if(studio: Studio, session, gamma, verify):
    """The cost tab's what-if chart at another γ / verify cost."""
    session = _session(session)
    cal = studio.calibration
    run = session.run
    c, alpha, c_big = 0.8, None, None
    if cal is not None:
        skip = run.skip if run is not None and run.skip is not None else cal.static
        c = cal.latency.draft_cost(skip, 256)
        c_big = 1.0 - studio.backbone.skip_weight_ratio(skip)
        stats = run.stats if run is not None else None
        alpha, label = _star(stats, int(gamma), cal.acceptance()["static"])
        return vcost.what_if_figure(int(gamma), c, float(verify), alpha, c_big=c_big, label=label)
    return vcost.what_if_figure(int(gamma), c, float(verify), alpha, c_big=c_big)


# --- handlers: Step through ---------------------------------------------------------------------------
def _walk_view(studio: Studio, walk: Walk | None) -> str:
    if walk is None:
        return vwalk.walk_html("", None, "draft", studio.backbone.token_str)
    if walk.done and walk.step is None:
        return '<div class="walk idle">The answer is complete. Press <b>Start</b> for another prompt.</div>'
    context = walk.prompt + "\n\n" + studio.backbone.decode(walk.ids)
    return vwalk.walk_html(context, walk.step, walk.phase, studio.backbone.token_str, walk.skip_desc)


def _advance(studio: Studio, walk: Walk) -> None:
    """Commit the current step to the context and fetch the next one."""
    if walk.step is not None:
        walk.ids.extend(walk.step.committed)
        if walk.step.finished:
            walk.step, walk.done = None, True
            return
    walk.step = next(walk.events, None)
    walk.phase = "draft"
    if walk.step is None:
        walk.done = True


def walk_start(studio: Studio, session, prompt, strategy_label, domain, gamma, k):
    session = _session(session)
    if not clean_prompt(prompt).strip():
        return session, '<div class="walk idle">Type a prompt first (or click an example).</div>'
    strategy = STRATEGIES.get(strategy_label, "knn")
    if strategy == "ar" or studio.calibration is None:
        strategy = "knn" if studio.calibration is not None else "ar"
    # teaching: model drafts only (no lookup), so every draft shows the draft's probabilities
    err, got = _problem(prompt, lambda: (make_config(256, gamma, 0.0, 0.0, 1.0, "int8"), safe_k(k)))
    if err:
        return session, f'<div class="walk idle">{html.escape(err)}</div>'
    cfg, k = got
    strat = make_strategy(studio, strategy, cfg.gamma, k, domain, cfg.draft)
    events = decode(studio.backbone, clean_prompt(prompt).strip(), strat, cfg)
    start = next(events)
    route = start.route.to_dict() if start.route else None
    skip = start.skip.to_dict() if start.skip else None
    desc = (f"the {route['domain'] or 'static'} set's {len(skip['attn'])} attention + {len(skip['mlp'])} MLP "
            "sublayers" if route and skip else
            f"{len(skip['attn'])} attention + {len(skip['mlp'])} MLP sublayers" if skip else "some sublayers")
    walk = Walk(events, clean_prompt(prompt).strip(), desc, ids=[start.first_token])
    _advance(studio, walk)
    session.walk = walk
    return session, _walk_view(studio, walk)


def walk_phase(studio: Studio, session, phase: str):
    session = _session(session)
    if session.walk is not None and session.walk.step is not None:
        session.walk.phase = phase
    return session, _walk_view(studio, session.walk)


def walk_next(studio: Studio, session):
    session = _session(session)
    if session.walk is not None and not session.walk.done:
        _advance(studio, session.walk)
    return session, _walk_view(studio, session.walk)


def walk_auto(studio: Studio, session, steps: int = 8, pause: float = 0.9):
    """Auto-play: draft → verify → accept → next, a pause between phases."""
    session = _session(session)
    walk = session.walk
    if walk is None:
        yield session, _walk_view(studio, None)
        return
    for _ in range(int(steps)):
        for phase in vwalk.PHASES:
            if walk.step is None:
                return
            walk.phase = phase
            yield session, _walk_view(studio, walk)
            time.sleep(pause)
        _advance(studio, walk)
        if walk.done:
            yield session, _walk_view(studio, walk)
            return


# --- handlers: calibration ---------------------------------------------------------------------------
def run_calibration(studio: Studio, progress=gr.Progress(track_tqdm=True)):
    """Build a quick calibration for the loaded model (tqdm bars show as a progress bar), then load it."""
    from ssd_core.calibration.build import calibrate
    progress(0, desc="calibrating (latency profile, skip-set search, router, UMAP)")
    try:
        cal = calibrate(studio.spec, studio.cal_folder, backbone=studio.backbone, progress=True,
                        **QUICK_CALIBRATION)
    except Exception as exc:
        return gr.update(value=_banner(f"Calibration failed: {exc}"), visible=True), gr.update(visible=True)
    dm, err = _load_map(cal)
    studio.install(cal, dm, err)
    return (gr.update(value=_banner(f"Calibration written to {studio.cal_folder} and loaded: reload the page "
                                    "to draft with it.", ok=True), visible=True),
            gr.update(visible=False))


def _banner(text: str, ok: bool = False) -> str:
    return f'<div class="banner {"ok" if ok else "warn"}">{vtok.escape(text)}</div>'


# --- layout ---------------------------------------------------------------------------------------------
TOOLTIP_JS = """
<script>
(() => {
  if (window.__ssdTip) return; window.__ssdTip = true;
  const tip = document.createElement('div'); tip.className = 'ssd-tip'; tip.setAttribute('role', 'tooltip');
  const place = (e) => { const r = e.getBoundingClientRect(); const w = tip.offsetWidth, h = tip.offsetHeight;
    let x = Math.min(Math.max(8, r.left + r.width / 2 - w / 2), window.innerWidth - w - 8);
    let y = r.top - h - 8; if (y < 8) y = r.bottom + 8; tip.style.left = x + 'px'; tip.style.top = y + 'px'; };
  document.addEventListener('mouseover', (ev) => {
    const el = ev.target.closest && ev.target.closest('[data-tip]'); if (!el) { tip.style.display = 'none'; return; }
    if (!tip.isConnected) document.body.appendChild(tip);
    tip.textContent = el.getAttribute('data-tip'); tip.style.display = 'block'; place(el); });
  document.addEventListener('scroll', () => { tip.style.display = 'none'; }, true);
  // keep the newest streamed tokens in view (the box is re-rendered on every step)
  new MutationObserver(() => { document.querySelectorAll('.token-stream').forEach((el) => {
    if (el.dataset.seen !== '1') { el.dataset.seen = '1'; el.scrollTop = el.scrollHeight; } }); })
    .observe(document.documentElement, { childList: true, subtree: true });
})();
</script>
"""


def header_html(studio: Studio) -> str:
    d = studio.backbone.describe()
    return ('<div class="app-header"><div class="app-title"><b>KNN-SSD Studio</b> · self-speculative decoding, '
            f'visualised</div><div class="app-model">model: <b>{vtok.escape(d["model"])}</b> · {d["n_layers"]} '
            f'layers · {d["params_m"]}M parameters · CPU</div><div class="app-explainer">The model drafts a few '
            "tokens with an int8 copy of itself (some layers skipped) or copies them from earlier text, then "
            "checks them in one pass of the full model — the text stays exactly what plain decoding would "
            "write.</div></div>")


ABOUT = """
### The method in five sentences
1. **Speculative decoding** drafts several tokens cheaply and verifies them in one parallel pass of the full
   model; greedy verification keeps the output identical to plain decoding.
2. **Self-speculative** decoding drafts with the *same* model while skipping some attention and MLP
   sublayers — no second model is needed.
3. Which sublayers can be skipped depends on the input's **domain**: a set tuned on summaries drafts badly
   on maths.
4. **KNN-SSD** searches one skip set per domain offline, embeds each prompt (the mean of the prefill's final
   hidden states — no extra forward pass), finds its K nearest anchors and drafts with that domain's set.
5. **KnapSpec** instead solves a knapsack: sublayers have measured latencies (attention grows with context),
   hidden-state similarity stands in for acceptance, and a DP picks the set that maximises tokens per second.

### Papers
- KNN-SSD — [arXiv 2505.16162](https://arxiv.org/abs/2505.16162)
- KnapSpec — [arXiv 2602.20217](https://arxiv.org/abs/2602.20217)
- SWIFT, on-the-fly self-speculative decoding — [arXiv 2410.06916](https://arxiv.org/abs/2410.06916)
- Draft & Verify — [arXiv 2309.08168](https://arxiv.org/abs/2309.08168)

### Run it yourself
```bash
make run    # installs everything, then serves this app on the embedded SmolLM2-135M
make test   # installs everything (incl. Debian's chromium), then runs the tests
```
Every speed shown is measured in this process against the core's own autoregressive loop, on the same
prompt. On a 135M model on a CPU, layer skipping alone stays *below* 1×; the default draft reads an
int8 copy of the same weights (the verifier stays fp32, so the text is unchanged) and tries prompt
lookup first, which is what makes it win here — the **Why (not) faster?** tab explains the numbers.
"""


THEME = gr.themes.Base(primary_hue="green", neutral_hue="slate", spacing_size="sm", radius_size="md",
                       font=[gr.themes.Font(n) for n in ("Inter", "ui-sans-serif", "system-ui", "sans-serif")])


def _css() -> str:
    return css_variables() + (ROOT / "assets" / "app.css").read_text(encoding="utf-8")


def build(studio: Studio) -> gr.Blocks:
    """The whole UI, declared once; every event calls a handler above."""
    cal = studio.calibration
    first_examples = {d: p[0] for d, p in studio.examples.items()}
    with gr.Blocks(title="KNN-SSD Studio") as demo:
        session = gr.State(None)
        gr.HTML(header_html(studio), elem_id="header")
        with gr.Row(visible=cal is None, elem_id="cal-row") as cal_row:
            banner = gr.HTML(_banner(f"No usable calibration for {studio.backbone.name}, so only autoregressive "
                                     f"decoding is available. ({studio.cal_error})") if cal is None else "")
            cal_btn = gr.Button("Run calibration (quick: ≈ 5–10 min on 2 cores)", variant="primary", scale=0,
                                min_width=260)
        with gr.Tabs():
            with gr.Tab("Generate", id="generate"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=4, min_width=330, elem_id="controls"):
                        prompt = gr.Textbox(label="Prompt", lines=3, max_lines=8, elem_id="prompt",
                                            value=first_examples.get("math", ""))
                        with gr.Row(elem_id="examples"):
                            ex_buttons = {d: gr.Button(d, size="sm", min_width=60, elem_classes=["ex", f"ex-{d}"])
                                          for d in studio.examples}
                        strategy = gr.Radio(list(STRATEGIES), value="KNN-SSD" if cal else "autoregressive",
                                            label="Strategy", elem_id="strategy")
                        oracle_domain = gr.Dropdown(list(DOMAINS), value="math", label="oracle domain",
                                                    visible=False)
                        with gr.Accordion("Advanced: draft, tokens, γ, threshold, sampling, K", open=False):
                            draft = gr.Radio(list(DRAFTS), value=DEFAULT_DRAFT, label="draft weights",
                                             elem_id="draft",
                                             info="int8: a quantised copy of the same weights drafts (the "
                                                  "verifier stays fp32); lookup: copy from earlier text first")
                            max_new = gr.Slider(8, 512, value=96, step=8, label="max new tokens")
                            gamma = gr.Slider(1, 12, value=4, step=1, label="draft length γ")
                            threshold = gr.Slider(0, 1, value=0.0, step=0.05, label="stop threshold",
                                                  info="stop drafting when the draft's top probability is below")
                            temperature = gr.Slider(0, 2, value=0.0, step=0.05, label="temperature (0 = greedy)")
                            top_p = gr.Slider(0.05, 1, value=1.0, step=0.05, label="top-p")
                            k = gr.Slider(1, 15, value=cal.router.k if cal else 5, step=1, label="K neighbours")
                        with gr.Row(elem_id="buttons-row"):
                            gen_btn = gr.Button("Generate", variant="primary", elem_id="generate-btn", min_width=80)
                            race_btn = gr.Button("Race vs AR", elem_id="race-btn", min_width=80)
                            stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn", min_width=60, scale=0)
                        race_view = gr.HTML(vstats.race_html(None), elem_id="race")
                    with gr.Column(scale=9, elem_id="outputs"):
                        gr.HTML(vtok.legend_html(), elem_id="legend")
                        tokens = gr.HTML(_tokens_view(studio, []), elem_id="tokens")
                        stats = gr.HTML(_stats_view(None, None), elem_id="stats")
                        route = gr.HTML(_route_view(None), elem_id="route")
                        with gr.Row(equal_height=True, elem_id="plots-row"):
                            domain_plot = gr.Plot(_map_fig(studio, None), show_label=False, elem_id="domain-map")
                            layer_plot = gr.Plot(_layer_fig(studio, None), show_label=False, elem_id="layer-map")
            with gr.Tab("Step through", id="walk"):
                gr.Markdown("One click per phase of one speculative step. Uses the prompt, strategy and γ of "
                            "the Generate tab (greedy).")
                with gr.Row(elem_id="walk-buttons"):
                    w_start = gr.Button("Start", variant="primary", elem_id="walk-start", min_width=90)
                    w_draft = gr.Button("1 · Draft", elem_id="walk-draft", min_width=90)
                    w_verify = gr.Button("2 · Verify", elem_id="walk-verify", min_width=90)
                    w_accept = gr.Button("3 · Accept", elem_id="walk-accept", min_width=90)
                    w_next = gr.Button("Next step →", elem_id="walk-next", min_width=90)
                    w_auto = gr.Button("▶ Auto-play", elem_id="walk-auto", min_width=90)
                    w_stop = gr.Button("Stop", variant="stop", min_width=70)
                walk_view = gr.HTML(_walk_view(studio, None), elem_id="walk")
            with gr.Tab("Why (not) faster?", id="cost"):
                cost_init, whatif_init = _cost_view(studio, None, None)
                cost = gr.HTML(cost_init, elem_id="cost")
                with gr.Row():
                    wi_gamma = gr.Slider(1, 12, value=4, step=1, label="what if: draft length γ")
                    wi_verify = gr.Slider(1.0, 2.5, step=0.01, label="what if: verify cost v (full steps)",
                                          value=round(cal.latency.verify_cost(5), 2) if cal else 1.3)
                what_if_plot = gr.Plot(whatif_init, show_label=False, elem_id="what-if")
            with gr.Tab("Domains & layer sets", id="domains"):
                d_text, d_sets, d_match = domains_views(studio)
                domains_md = gr.Markdown(d_text)
                sets_plot = gr.Plot(d_sets, show_label=False, visible=cal is not None)
                match_plot = gr.Plot(d_match, show_label=False, visible=cal is not None)
            with gr.Tab("Benchmark", id="bench"):
                b = studio.bench
                gr.HTML(vbench.summary_html(b["summary"], b["summary_path"]) + vbench.core_html(b["core"]))
                for fig in bench_plots(b):
                    gr.Plot(fig, show_label=False)
                for path, text in b["markdown"]:
                    with gr.Accordion(path, open=False):
                        gr.Markdown(text)
            with gr.Tab("About", id="about"):
                gr.Markdown(ABOUT)

        # --- wiring -------------------------------------------------------------------------------
        gen_inputs = [session, prompt, strategy, oracle_domain, max_new, gamma, threshold, temperature, top_p, k,
                      draft]
        gen_outputs = [session, tokens, stats, route, domain_plot, layer_plot, race_view, cost, what_if_plot]
        model_lane = dict(concurrency_limit=1, concurrency_id="model", show_progress="hidden")
        gen_evt = gen_btn.click(partial(generate, studio), gen_inputs, gen_outputs, **model_lane)
        sub_evt = prompt.submit(partial(generate, studio), gen_inputs, gen_outputs, **model_lane)
        race_evt = race_btn.click(partial(race, studio), gen_inputs, gen_outputs, **model_lane)
        for d, btn in ex_buttons.items():
            btn.click(partial(pick_example, studio, domain=d), [session], [session, prompt, oracle_domain],
                      queue=False, show_progress="hidden")
        strategy.change(strategy_changed, strategy, oracle_domain, queue=False, show_progress="hidden")
        walk_out = [session, walk_view]
        w_start.click(partial(walk_start, studio), [session, prompt, strategy, oracle_domain, gamma, k], walk_out,
                      **model_lane)
        for btn, phase in ((w_draft, "draft"), (w_verify, "verify"), (w_accept, "accept")):
            btn.click(partial(walk_phase, studio, phase=phase), [session], walk_out, queue=False,
                      show_progress="hidden")
        w_next.click(partial(walk_next, studio), [session], walk_out, **model_lane)
        auto_evt = w_auto.click(partial(walk_auto, studio), [session], walk_out, **model_lane)
        stop_btn.click(partial(stop, studio), [session], [session, tokens, stats],
                       cancels=[gen_evt, sub_evt, race_evt], queue=False)
        w_stop.click(stop_walk, [session], [session], cancels=[auto_evt], queue=False)
        for ctl in (wi_gamma, wi_verify):
            ctl.release(partial(what_if, studio), [session, wi_gamma, wi_verify], what_if_plot,
                        show_progress="hidden")
        cal_btn.click(partial(run_calibration, studio), None, [banner, cal_btn], concurrency_limit=1,
                      concurrency_id="model")
        fresh = [session, cal_row, banner, strategy, k, domain_plot, layer_plot, cost, what_if_plot, domains_md,
                 sets_plot, match_plot]
        demo.load(partial(page_load, studio, cal), [session], fresh, show_progress="hidden")
        def generate_text_api(prompt: str, strategy: str = "KNN-SSD", max_new_tokens: float = 64,
                              gamma: float = 4, threshold: float = 0.0, temperature: float = 0.0,
                              top_p: float = 1.0, draft: str = DEFAULT_DRAFT) -> dict:
            return generate_text(studio, prompt, strategy, max_new_tokens, gamma, threshold, temperature, top_p,
                                 draft)
        gr.api(generate_text_api, api_name="generate_text", concurrency_limit=1, concurrency_id="model")
    return demo


def main(argv=None):
    ap = argparse.ArgumentParser(description="KNN-SSD Studio: self-speculative decoding, visualised")
    ap.add_argument("--model", default=None, help="HF id, local folder or .gguf (default: embedded SmolLM2-135M)")
    ap.add_argument("--calibration", default=None,
                    help="calibration folder (default: assets/calibration/<model slug>)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if os.environ.get("SPACE_ID") and args.model not in ALLOWED_MODELS:
        raise SystemExit(f"--model {args.model!r} is not on this Space's allow-list: {ALLOWED_MODELS[2:]}")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    imports_s = time.perf_counter() - T_LAUNCH
    studio = load_studio(args.model, args.calibration, threads=args.threads, map_in_background=True)
    demo = build(studio)
    t = studio.timings
    where = f"loaded from {studio.cal_folder}" if studio.calibration else studio.cal_error
    print(f"start-up ({'cold: first run converts the GGUF' if t['cold'] else 'warm: model from cache'}): "
          f"{time.perf_counter() - T_LAUNCH:.1f} s (imports {imports_s:.1f} s, model {t['model_s']} s, "
          f"calibration + warm-up {t['ready_s'] - t['model_s']:.1f} s; the UMAP domain map loads in the "
          f"background); calibration: {where}", flush=True)
    demo.queue(default_concurrency_limit=4, max_size=QUEUE_SIZE).launch(css=_css(), head=TOOLTIP_JS, theme=THEME,
                                                                      max_file_size="1mb")


if __name__ == "__main__":
    main()
