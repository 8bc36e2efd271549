"""KNN-SSD Studio — the Gradio app: self-speculative decoding, visualised.

    python app.py [--model SPEC] [--calibration DIR]

ssd_core produces the events (Start, Step), viz/ turns them into HTML and plotly figures and holds the
Gradio-free handlers (viz.studio: shared resources and request checks; viz.session: per-session state
and views; viz.handlers, race_handlers, page_handlers, api_handlers, walk_handlers, trace_handlers: the
events; viz.adapter: named outputs → Gradio's positional ones, and the queue's door). This file declares
the Blocks layout (a builder per tab), connects every event in one function (`wire`), and has `main`.
"""
from __future__ import annotations

import os
import threading
import time

T_LAUNCH = time.perf_counter()     # start-up is timed from here: what someone running `python app.py` waits

# OpenMP's wait policy is left at its default (spin briefly, then sleep): on two cores of its own,
# sleeping threads made every small matmul pay a wake-up, and the int8 draft step took 34 ms instead
# of 16 ms. On a CPU shared with other heavy jobs, set OMP_WAIT_POLICY=PASSIVE before starting.
# numba's threading layer (UMAP) is set where the resources load, in viz.studio.
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")   # no usage data leaves the server (docs/space.md)
if __name__ == "__main__":
    # A script is never a notebook: gradio imports IPython for its notebook magics when it is installed
    # (0.6 s of a warm start-up on 2 cores); marked absent, gradio's own ImportError fallbacks apply.
    import sys
    sys.modules.setdefault("IPython", None)

import argparse
import logging
from functools import partial

import gradio as gr

from ssd_core.calibration.domains import DOMAINS
from ssd_core.engine.device import add_device_argument
from ssd_core.engine.loading import ModelNotFoundError
from viz import benchmark as vbench
from viz import handlers as h
from viz import page_handlers as ph
from viz import race_handlers as rh
from viz import stats as vstats
from viz import tokens as vtok
from viz import trace_handlers as th
from viz import walk_handlers as wh
from viz import session as vs
from viz import startup
from viz.adapter import gate_per_visitor, outputs, register_apis, upload_forgetter, wired
from viz.benchmark import bench_plots
from viz.limits import Limits, parse_overrides, private_server
from viz.studio import ALLOWED_MODELS, DEFAULT_DRAFT_LABEL, DRAFTS, ROOT, STRATEGY_OF_LABEL, Studio, public_message
from viz.theme import css_variables

ASSETS = ROOT / "assets"
TOOLTIP_JS = "\n<script>\n" + (ASSETS / "app.js").read_text(encoding="utf-8") + "</script>\n"
ABOUT = (ASSETS / "about.md").read_text(encoding="utf-8")
FAVICON = ASSETS / "favicon.png"


def run_calibration(studio: Studio, progress=gr.Progress(track_tqdm=True)):
    """The calibration button: viz.startup.run_calibration with Gradio's progress bar."""
    return outputs(startup.run_calibration(studio, progress), ("banner", "cal_btn"))


def calibration_event_allowed(studio: Studio) -> bool:
    """Calibrating writes assets/calibration/ and changes the drafts of every visitor: an admin action. The app
    registers its event only with no calibration loaded, on a private server; elsewhere it is a command line."""
    return studio.calibration is None and private_server()


THEME = gr.themes.Base(primary_hue="green", neutral_hue="slate", spacing_size="sm", radius_size="md",
                       font=[gr.themes.Font(n) for n in ("Inter", "ui-sans-serif", "system-ui", "sans-serif")])


def _css() -> str:
    return css_variables() + (ASSETS / "app.css").read_text(encoding="utf-8")


def build(studio: Studio) -> gr.Blocks:
    """The whole UI, declared once (a builder per tab), then wired; every event calls a handler in viz."""
    lim = studio.limits
    with gr.Blocks(title="KNN-SSD Studio", delete_cache=(max(60, lim.cache_age_s // 4), lim.cache_age_s)) as demo:
        ui = dict(session=gr.State(None, time_to_live=lim.session_ttl_s))
        gr.HTML(vs.header_html(studio), elem_id="header")
        ui.update(calibration_row(studio))
        with gr.Tabs():
            for title, tab_id, tab in (("Generate", "generate", generate_tab), ("Step through", "walk", walk_tab),
                                       ("Why (not) faster?", "cost", cost_tab),
                                       ("Domains & layer sets", "domains", domains_tab),
                                       ("Benchmark", "bench", bench_tab), ("About", "about", about_tab)):
                with gr.Tab(title, id=tab_id):
                    ui.update(tab(studio) or {})
        wire(demo, studio, ui)
    return demo


def calibration_row(studio: Studio) -> dict:
    """Without a calibration: a banner that says so and (on a private server) the button that builds one."""
    cal, admin = studio.calibration, calibration_event_allowed(studio)
    with gr.Row(visible=cal is None, elem_id="cal-row") as cal_row:
        how = ("" if admin else " Calibrating is an admin's job here: run `python -m ssd_core.calibrate --out "
               f"{public_message(str(studio.cal_folder))}` on the server, then restart the app.")
        banner = gr.HTML(vs.banner(f"No usable calibration for {studio.backbone.name}, so only autoregressive "
                                   f"decoding is available. ({studio.cal_error}){how}") if cal is None else "")
        cal_btn = gr.Button("Run calibration (quick: ≈ 5–10 min on 2 cores)", variant="primary", scale=0,
                            min_width=260, visible=admin)
    return dict(cal_row=cal_row, banner=banner, cal_btn=cal_btn)


def generate_tab(studio: Studio) -> dict:
    """The settings on the left; the run's tokens, stats, domain map and layer map on the right."""
    with gr.Row(equal_height=False):
        with gr.Column(scale=4, min_width=330, elem_id="controls"):
            ui = settings_column(studio)
        with gr.Column(scale=9, elem_id="outputs"):
            gr.HTML(vtok.legend_html(), elem_id="legend")
            ui.update(tokens=gr.HTML(vs.tokens_view(studio, []), elem_id="tokens"),
                      stats=gr.HTML(vs.stats_view(None, None), elem_id="stats"))
            with gr.Row(equal_height=True, elem_id="plots-row"):
                with gr.Column(scale=6, min_width=320, elem_id="map-col"):   # the map, then its K nearest
                    ui.update(map_view=gr.Radio(list(h.MAP_VIEWS), value=h.MAP_VIEWS[0], show_label=False,
                                                container=False, elem_id="map-zoom"),
                              domain_plot=gr.Plot(vs.map_fig(studio, None), show_label=False, elem_id="domain-map"),
                              route=gr.HTML(vs.route_view(None), elem_id="route"))
                ui["layer_plot"] = gr.Plot(vs.layer_fig(studio, None), show_label=False, elem_id="layer-map",
                                           scale=5, min_width=300)
    return ui


def settings_column(studio: Studio) -> dict:
    """Prompt, examples, strategy, calibration, advanced settings, the buttons, the race and the trace."""
    cal, lim, ui = studio.calibration, studio.limits, {}
    ui["prompt"] = gr.Textbox(label="Prompt", lines=3, max_lines=8, elem_id="prompt",
                              value=(studio.examples.get("math") or [""])[0])
    with gr.Row(elem_id="examples"):     # "Try these": one click fills a prompt and races it
        gr.HTML('<span title="one click: a held-out prompt of that domain, raced against '
                'autoregressive">Try these ▸</span>', elem_classes=["try-label"])
        ui["examples"] = {d: gr.Button(d, size="sm", min_width=60, elem_classes=["ex", f"ex-{d}"])
                          for d in studio.examples}
    ui["strategy"] = gr.Radio(list(STRATEGY_OF_LABEL), value="KNN-SSD" if cal else "autoregressive",
                              label="Strategy", elem_id="strategy")
    ui["oracle_domain"] = gr.Dropdown(list(DOMAINS), value="math", label="oracle domain", visible=False)
    with gr.Group(visible=len(studio.choices) > 1, elem_id="cal-choice"):
        ui["cal_choice"] = gr.Dropdown([(c.title, c.name) for c in studio.choices.values()],
                                       value=next(iter(studio.choices), None), label="Calibration",
                                       elem_id="calibration", info="your own choice: other visitors keep theirs")
        ui["cal_info"] = gr.HTML(ph.calibration_info(studio, None), elem_id="cal-info")
    with gr.Accordion("Advanced: draft, tokens, γ, threshold, sampling, K", open=False):
        ui["draft"] = gr.Radio(list(DRAFTS), value=DEFAULT_DRAFT_LABEL, label="draft weights", elem_id="draft",
                               info="int8: a quantised copy of the same weights drafts (the verifier stays "
                                    "fp32); lookup: copy from earlier text first")
        ui["max_new"] = gr.Slider(8, lim.max_new_tokens, value=min(96, lim.max_new_tokens), step=8,
                                  label="max new tokens")
        ui["gamma"] = gr.Slider(1, 12, value=4, step=1, label="draft length γ")
        ui["threshold"] = gr.Slider(0, 1, value=0.0, step=0.05, label="stop threshold",
                                    info="stop drafting when the draft's top probability is below")
        ui["temperature"] = gr.Slider(0, 2, value=0.0, step=0.05, label="temperature (0 = greedy)")
        ui["top_p"] = gr.Slider(0.05, 1, value=1.0, step=0.05, label="top-p")
        ui["seed"] = gr.Number(None, precision=0, minimum=0, label="seed (blank = a new one each run)",
                               info="sampling only; the trace records the seed a run used")
        ui["k"] = gr.Slider(1, 15, value=cal.router.k if cal else 5, step=1, label="K neighbours")
    with gr.Row(elem_id="buttons-row"):
        for name, label, elem_id in (("gen_btn", "Generate", "generate-btn"), ("race_btn", "Race vs AR", "race-btn"),
                                     ("race_static_btn", "Race vs static", "race-static-btn")):
            ui[name] = gr.Button(label, variant="primary" if name == "gen_btn" else "secondary", elem_id=elem_id,
                                 min_width=80)
        ui["stop_btn"] = gr.Button("Stop", variant="stop", elem_id="stop-btn", min_width=60, scale=0)
    ui["race"] = gr.HTML(vstats.race_html(None), elem_id="race")
    ui["trace_file"] = gr.HTML(vs.trace_download(studio, vs.Session()), elem_id="trace-download")
    with gr.Accordion("Replay a trace (no model runs)", open=False, elem_id="replay-box"):
        ui["trace_in"] = gr.File(label="trace file (.json)", file_types=[".json"], type="binary",
                                 elem_id="trace-upload", height=90)
        with gr.Row():
            ui["replay_speed"] = gr.Dropdown(list(th.SPEEDS), value=th.DEFAULT_SPEED,
                                             label="speed (1× = as recorded)", min_width=120)
            ui["replay_btn"] = gr.Button("▶ Replay", elem_id="replay-btn", min_width=80)
    return ui


def walk_tab(studio: Studio) -> dict:
    gr.Markdown("One click per phase of one speculative step. Uses the prompt, strategy and γ of the Generate "
                "tab (greedy).")
    with gr.Row(elem_id="walk-buttons"):
        ui = {f"w_{name}": gr.Button(label, variant="primary" if name == "start" else "secondary",
                                     elem_id=f"walk-{name}", min_width=90)
              for name, label in (("start", "Start"), ("draft", "1 · Draft"), ("verify", "2 · Verify"),
                                  ("accept", "3 · Accept"), ("next", "Next step →"), ("auto", "▶ Auto-play"))}
        ui["w_stop"] = gr.Button("Stop", variant="stop", min_width=70)
    return dict(ui, walk=gr.HTML(wh.walk_view(studio, None), elem_id="walk"))


def cost_tab(studio: Studio) -> dict:
    cal, (cost, what_if) = studio.calibration, vs.cost_view(studio, None, None)
    ui = dict(cost=gr.HTML(cost, elem_id="cost"))
    with gr.Row():
        ui["wi_gamma"] = gr.Slider(1, 12, value=4, step=1, label="what if: draft length γ")
        ui["wi_verify"] = gr.Slider(1.0, 2.5, step=0.01, label="what if: verify cost v (full steps)",
                                    value=ph.what_if_verify(cal))
    ui["what_if"] = gr.Plot(what_if, show_label=False, elem_id="what-if")
    # the batch dimension: speculation in a batch shared with other visitors (viz.batch_view)
    return dict(ui, batch_plot=gr.Plot(vs.batch_view(studio, None), show_label=False, elem_id="batch-curve"))


def domains_tab(studio: Studio) -> dict:
    (text, sets, match), shown = vs.domains_views(studio), studio.calibration is not None
    return dict(domains_md=gr.Markdown(text), sets_plot=gr.Plot(sets, show_label=False, visible=shown),
                match_plot=gr.Plot(match, show_label=False, visible=shown))


def bench_tab(studio: Studio) -> None:
    b = studio.bench
    gr.HTML(vbench.summary_html(b["summary"], b["summary_path"]) + vbench.core_html(b["core"]))
    for fig in bench_plots(b):
        gr.Plot(fig, show_label=False)
    for path, text in b["markdown"]:
        with gr.Accordion(path, open=False):
            gr.Markdown(text)


def about_tab(studio: Studio) -> None:
    gr.Markdown(ABOUT, elem_id="about", latex_delimiters=[{"left": "$$", "right": "$$", "display": True},
                                                           {"left": "$", "right": "$", "display": False}])


def wire(demo: gr.Blocks, studio: Studio, ui: dict) -> None:
    """Every event: trigger → handler in viz → the components named as the handler names its outputs.

    Lanes: only what runs the model holds the model's lane, and only while it runs: up to `max_rows` at once,
    each a row of the serving engine's shared batch (viz.startup.start_engine); replay and auto-play pace
    themselves in lanes of their own. A waiting visitor sees the queue position and Gradio's estimate on the
    panel the request will fill (and, on Generate, the engine's own queue: viz.handlers.show_events)."""
    def of(*names):
        return [ui[n] for n in names]
    GEN, walk, session = h.GEN_OUTPUTS, ("session", "walk"), ui["session"]
    gen_in = of("session", "prompt", "strategy", "oracle_domain", "max_new", "gamma", "threshold", "temperature",
                "top_p", "k", "draft", "seed")
    rows = studio.limits.max_rows
    lane = dict(concurrency_limit=rows, concurrency_id="model", show_progress="full", show_progress_on=[ui["tokens"]])
    quiet = dict(queue=False, show_progress="hidden", api_visibility="private")
    runs = [ui["gen_btn"].click(wired(h.generate, GEN, studio), gen_in, of(*GEN), api_name="generate", **lane),
            ui["prompt"].submit(wired(h.generate, GEN, studio), gen_in, of(*GEN), api_visibility="private", **lane),
            ui["race_btn"].click(wired(rh.race, GEN, studio), gen_in, of(*GEN), api_name="race", **lane),
            ui["race_static_btn"].click(wired(rh.race_static, GEN, studio), gen_in, of(*GEN),
                                        api_name="race_static", **lane)]
    picked = ("session", "prompt", "oracle_domain")
    runs += [btn.click(wired(h.pick_example, picked, studio, domain=d), [session], of(*picked), **quiet)
             .then(wired(rh.race, GEN, studio), gen_in, of(*GEN), api_visibility="private", **lane)
             for d, btn in ui["examples"].items()]
    ui["map_view"].change(wired(h.map_zoom, ("session", "domain_plot"), studio), of("session", "map_view"),
                          of("session", "domain_plot"), **quiet)
    ui["cal_choice"].change(wired(ph.choose_calibration, ph.CHOOSE_OUTPUTS, studio), of("session", "cal_choice"),
                            of(*ph.CHOOSE_OUTPUTS), queue=False, show_progress="hidden",
                            api_name="choose_calibration")
    ui["strategy"].change(wired(h.strategy_changed, ["oracle_domain"]), ui["strategy"], ui["oracle_domain"], **quiet)
    replay = ui["replay_btn"].click(wired(th.replay, th.REPLAY_OUTPUTS, studio, discard=upload_forgetter()),
                                    of("session", "trace_in", "replay_speed"), of(*th.REPLAY_OUTPUTS),
                                    concurrency_limit=8, concurrency_id="replay", show_progress="hidden",
                                    api_name="replay")
    walk_start = ui["w_start"].click(wired(wh.walk_start, walk, studio),
                                     of("session", "prompt", "strategy", "oracle_domain", "gamma", "k"), of(*walk),
                                     api_name="walk_start", concurrency_limit=rows, concurrency_id="model",
                                     show_progress="full", show_progress_on=[ui["walk"]])
    for phase in ("draft", "verify", "accept"):
        ui[f"w_{phase}"].click(wired(wh.walk_phase, walk, studio, phase=phase), [session], of(*walk), **quiet)
    ui["w_next"].click(wired(wh.walk_next, walk, studio), [session], of(*walk), queue=False, show_progress="hidden",
                       api_name="walk_next")
    auto = ui["w_auto"].click(wired(wh.walk_auto, walk, studio), [session], of(*walk), concurrency_limit=8,
                              concurrency_id="walk", show_progress="hidden", api_name="walk_auto")
    ui["stop_btn"].click(wired(h.stop, ("session", "tokens", "stats"), studio), [session],
                         of("session", "tokens", "stats"), cancels=[*runs, replay], queue=False, api_name="stop")
    ui["w_stop"].click(wired(wh.stop_walk, ["session"]), [session], [session], cancels=[auto], queue=False,
                       api_visibility="private")
    for ctl in (ui["wi_gamma"], ui["wi_verify"]):
        ctl.release(wired(h.what_if, ["what_if"], studio), of("session", "wi_gamma", "wi_verify"), ui["what_if"],
                    show_progress="hidden", api_visibility="private")
    # never on a public server (any registered event can be posted); with it (private, no calibration yet) the
    # shared lane takes its smallest limit and runs one at a time: calibrating times the model, and must not share it
    if calibration_event_allowed(studio):
        ui["cal_btn"].click(partial(run_calibration, studio), None, of("banner", "cal_btn"), concurrency_limit=1,
                            concurrency_id="model", api_visibility="private")
    demo.load(wired(ph.page_load, ph.PAGE_OUTPUTS, studio, studio.calibration), [session], of(*ph.PAGE_OUTPUTS),
              show_progress="hidden", api_visibility="private")

    register_apis(studio, rows)         # /generate_text (the model's lane) and /engine_status
    if len(studio.choices) > 1:     # a run may have built a draft: the chooser's memory line says so
        for run in [*runs, walk_start]:
            run.then(wired(ph.cal_info, ["cal_info"], studio), [session], ui["cal_info"], **quiet)


def launch(demo: gr.Blocks, studio: Studio, **kwargs):
    """Queue and serve `demo` under the studio's caps (queue size, upload size, per-visitor requests).
    Threads: each model-lane event holds one while its row is in the batch (up to max_rows), beside the
    replay and auto-play lanes (8 each) and the quick events; Gradio's default is 40."""
    lim = studio.limits
    demo.queue(default_concurrency_limit=4, max_size=lim.queue_size)
    gate_per_visitor(demo._queue, lim.in_flight)
    kwargs.setdefault("max_threads", max(40, 2 * lim.max_rows + 16))
    return demo.launch(css=_css(), head=TOOLTIP_JS, theme=THEME, max_file_size=f"{lim.upload_kb}kb",
                       favicon_path=FAVICON, **kwargs)


def main(argv=None):
    ap = argparse.ArgumentParser(description="KNN-SSD Studio: self-speculative decoding, visualised")
    ap.add_argument("--model", default=None, help="HF id, local folder or .gguf (default: embedded SmolLM2-135M)")
    ap.add_argument("--calibration", default=None, help="calibration folder (default: assets/calibration/<slug>)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cap", action="append", metavar="NAME=VALUE", default=[],
                    help="raise or lower one cap (repeatable), e.g. --cap max_new_tokens=384; names and defaults "
                         "in docs/space.md; a Space sets them with variables (SSD_MAX_NEW_TOKENS, ...)")
    add_device_argument(ap)
    args = ap.parse_args(argv)
    if os.environ.get("SPACE_ID") and args.model not in ALLOWED_MODELS:
        raise SystemExit(f"--model {args.model!r} is not on this Space's allow-list: {ALLOWED_MODELS[2:]}")
    try:
        limits = Limits.resolve(overrides=parse_overrides(args.cap))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    imports_s = time.perf_counter() - T_LAUNCH
    try:
        # torch stays off the main thread (viz.startup.off_main says why)
        studio = startup.off_main(startup.load_studio, args.model, args.calibration, threads=args.threads,
                                  map_in_background=True, device=args.device, limits=limits, warm=False)
    except ModelNotFoundError as exc:       # one sentence that says what to do, no traceback
        raise SystemExit(str(exc)) from None
    t_ui = time.perf_counter()
    # the UI builds while the warm-up decode runs (its torch work releases the GIL): ~1.4 s less start-up
    warming = threading.Thread(target=startup.warm_up, args=(studio,), name="warm-up", daemon=True)
    warming.start()
    demo = build(studio)
    warming.join()
    engine = startup.start_engine(studio)     # after the warm-up: from here the engine owns the model's passes
    t = studio.timings
    where = f"loaded from {studio.cal_folder}" if studio.calibration else studio.cal_error
    print(f"start-up ({'cold: first run converts the GGUF' if t['cold'] else 'warm: model from cache'}): "
          f"{time.perf_counter() - T_LAUNCH:.1f} s (imports {imports_s:.1f} s, model {t['model_s']} s, "
          f"calibration {t['ready_s'] - t['model_s']:.1f} s, warm-up beside the UI build "
          f"{time.perf_counter() - t_ui:.1f} s; the UMAP domain map loads in the background); "
          f"calibration: {where}", flush=True)
    print(f"caps ({'public Space' if limits.public else 'local'}): {limits.describe()}", flush=True)
    print(f"serving up to {engine.max_rows} requests in one batch (KV budget {limits.kv_budget_mb} MB)", flush=True)
    launch(demo, studio, prevent_thread_lock=True)
    studio.start_map()              # the UMAP map compiles in the background once the server is up
    demo.block_thread()


if __name__ == "__main__":
    main()
