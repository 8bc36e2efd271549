"""KNN-SSD Studio — the Gradio app: self-speculative decoding, visualised.

    python app.py [--model SPEC] [--calibration DIR]

ssd_core produces the events (Start, Step), viz/ turns them into HTML and plotly figures and holds the
Gradio-free handlers (viz.studio: shared resources and request checks; viz.session: per-session state
and views; viz.handlers, viz.walk_handlers: the events). This file only wires them: the Blocks layout,
one adapter from named outputs to Gradio's positional ones, and `main`.
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
import inspect
import logging
from functools import partial

import gradio as gr
from gradio import processing_utils

from ssd_core.calibration.domains import DOMAINS
from ssd_core.engine.device import add_device_argument
from viz import benchmark as vbench
from viz import handlers as h
from viz import stats as vstats
from viz import tokens as vtok
from viz import trace_handlers as th
from viz import walk_handlers as wh
from viz import session as vs
from viz import startup
from viz.limits import (UPLOAD_GRACE_S, LaterDelete, Limits, busy_message, forget_upload, parse_overrides,
                        private_server)
from viz.benchmark import bench_plots
from viz.studio import (ALLOWED_MODELS, DEFAULT_DRAFT_LABEL, DRAFTS, ROOT, STRATEGY_OF_LABEL, Studio, Update,
                        public_message)
from viz.theme import css_variables

ASSETS = ROOT / "assets"
TOOLTIP_JS = "\n<script>\n" + (ASSETS / "app.js").read_text(encoding="utf-8") + "</script>\n"
ABOUT = (ASSETS / "about.md").read_text(encoding="utf-8")
FAVICON = ASSETS / "favicon.png"


# --- the one adapter: named outputs → Gradio's positional outputs ------------------------------------
def outputs(named: dict, names) -> tuple | object:
    """The values for `names` in order: a name not given stays as it is (gr.skip()), an Update becomes
    gr.update(...). One name gives the bare value, as Gradio expects for a single output."""
    def one(name):
        if name not in named:
            return gr.skip()
        value = named[name]
        return gr.update(**value.changes()) if isinstance(value, Update) else value
    values = tuple(one(n) for n in names)
    return values[0] if len(values) == 1 else values


def _call(handler, names, *args, **kwargs):
    return outputs(handler(*args, **kwargs), names)


def _stream(handler, names, *args, **kwargs):
    for named in handler(*args, **kwargs):
        yield outputs(named, names)


def wired(handler, names, *args, **kwargs):
    """`handler` (with `args`/`kwargs` bound first) as a Gradio event function for the outputs `names`."""
    fn = partial(_stream if inspect.isgeneratorfunction(handler) else _call, handler, tuple(names), *args,
                 **kwargs)
    if args or kwargs or inspect.isgeneratorfunction(handler):
        return fn

    def named(*a, **kw):
        return fn(*a, **kw)
    named.__name__ = handler.__name__        # an unbound handler keeps its name as the event's API name
    return named


def run_calibration(studio: Studio, progress=gr.Progress(track_tqdm=True)):
    """The calibration button: viz.startup.run_calibration with Gradio's progress bar."""
    return outputs(startup.run_calibration(studio, progress), ("banner", "cal_btn"))


# --- what a public server must not let one visitor do ------------------------------------------------
def calibration_event_allowed(studio: Studio) -> bool:
    """Calibrating writes assets/calibration/ and changes the drafts of every visitor: an admin action. The app
    registers its event only with no calibration loaded, on a private server; elsewhere it is a command line."""
    return studio.calibration is None and private_server()


def upload_forgetter(delay_s: float = UPLOAD_GRACE_S):
    """For an uploaded trace once read: delete Gradio's copy (its folder is named by Gradio's hash of the
    bytes) `delay_s` later; 0 deletes at once."""
    later = LaterDelete(delay_s) if delay_s > 0 else forget_upload
    return lambda content: later(processing_utils.hash_bytes(content))


def gate_per_visitor(queue, cap: int) -> None:
    """At most `cap` events of one visitor (a browser session or an API client) queued or running at once;
    one more is refused at the queue's door with a sentence (HTTP 400 to an API client, a toast in the page)."""
    push = queue.push

    async def gated(body, request, username=None):
        mine = body.session_hash
        held = sum(e.session_hash == mine for q in queue.event_queue_per_concurrency_id.values() for e in q.queue)
        held += sum(e.session_hash == mine for jobs in queue.active_jobs if jobs for e in jobs)
        if mine is not None and held >= cap:
            return False, busy_message(held, cap), "error"
        return await push(body, request, username)
    queue.push = gated


THEME = gr.themes.Base(primary_hue="green", neutral_hue="slate", spacing_size="sm", radius_size="md",
                       font=[gr.themes.Font(n) for n in ("Inter", "ui-sans-serif", "system-ui", "sans-serif")])


def _css() -> str:
    return css_variables() + (ASSETS / "app.css").read_text(encoding="utf-8")


def build(studio: Studio) -> gr.Blocks:
    """The whole UI, declared once; every event calls a handler above."""
    cal, lim = studio.calibration, studio.limits
    admin = calibration_event_allowed(studio)
    first_examples = {d: p[0] for d, p in studio.examples.items()}
    with gr.Blocks(title="KNN-SSD Studio", delete_cache=(max(60, lim.cache_age_s // 4), lim.cache_age_s)) as demo:
        session = gr.State(None, time_to_live=lim.session_ttl_s)
        gr.HTML(vs.header_html(studio), elem_id="header")
        with gr.Row(visible=cal is None, elem_id="cal-row") as cal_row:
            how = ("" if admin else " Calibrating is an admin's job here: run `python -m ssd_core.calibrate --out "
                   f"{public_message(str(studio.cal_folder))}` on the server, then restart the app.")
            banner = gr.HTML(vs.banner(f"No usable calibration for {studio.backbone.name}, so only autoregressive "
                                     f"decoding is available. ({studio.cal_error}){how}") if cal is None else "")
            cal_btn = gr.Button("Run calibration (quick: ≈ 5–10 min on 2 cores)", variant="primary", scale=0,
                                min_width=260, visible=admin)
        with gr.Tabs():
            with gr.Tab("Generate", id="generate"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=4, min_width=330, elem_id="controls"):
                        prompt = gr.Textbox(label="Prompt", lines=3, max_lines=8, elem_id="prompt",
                                            value=first_examples.get("math", ""))
                        with gr.Row(elem_id="examples"):     # "Try these": one click fills a prompt and races it
                            gr.HTML('<span title="one click: a held-out prompt of that domain, raced against '
                                    'autoregressive">Try these ▸</span>', elem_classes=["try-label"])
                            ex_buttons = {d: gr.Button(d, size="sm", min_width=60, elem_classes=["ex", f"ex-{d}"])
                                          for d in studio.examples}
                        strategy = gr.Radio(list(STRATEGY_OF_LABEL), value="KNN-SSD" if cal else "autoregressive",
                                            label="Strategy", elem_id="strategy")
                        oracle_domain = gr.Dropdown(list(DOMAINS), value="math", label="oracle domain",
                                                    visible=False)
                        with gr.Group(visible=len(studio.choices) > 1, elem_id="cal-choice"):
                            cal_choice = gr.Dropdown([(c.title, c.name) for c in studio.choices.values()],
                                                     value=next(iter(studio.choices), None), label="Calibration",
                                                     elem_id="calibration", info="your own choice: other "
                                                     "visitors keep theirs")
                            cal_info = gr.HTML(h.calibration_info(studio, None), elem_id="cal-info")
                        with gr.Accordion("Advanced: draft, tokens, γ, threshold, sampling, K", open=False):
                            draft = gr.Radio(list(DRAFTS), value=DEFAULT_DRAFT_LABEL, label="draft weights",
                                             elem_id="draft",
                                             info="int8: a quantised copy of the same weights drafts (the "
                                                  "verifier stays fp32); lookup: copy from earlier text first")
                            max_new = gr.Slider(8, lim.max_new_tokens, value=min(96, lim.max_new_tokens), step=8,
                                                label="max new tokens")
                            gamma = gr.Slider(1, 12, value=4, step=1, label="draft length γ")
                            threshold = gr.Slider(0, 1, value=0.0, step=0.05, label="stop threshold",
                                                  info="stop drafting when the draft's top probability is below")
                            temperature = gr.Slider(0, 2, value=0.0, step=0.05, label="temperature (0 = greedy)")
                            top_p = gr.Slider(0.05, 1, value=1.0, step=0.05, label="top-p")
                            seed = gr.Number(None, precision=0, minimum=0, label="seed (blank = a new one each run)",
                                             info="sampling only; the trace records the seed a run used")
                            k = gr.Slider(1, 15, value=cal.router.k if cal else 5, step=1, label="K neighbours")
                        with gr.Row(elem_id="buttons-row"):
                            gen_btn = gr.Button("Generate", variant="primary", elem_id="generate-btn", min_width=80)
                            race_btn = gr.Button("Race vs AR", elem_id="race-btn", min_width=80)
                            race_static_btn = gr.Button("Race vs static", elem_id="race-static-btn", min_width=80)
                            stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn", min_width=60, scale=0)
                        race_view = gr.HTML(vstats.race_html(None), elem_id="race")
                        trace_dl = gr.HTML(vs.trace_download(studio, vs.Session()), elem_id="trace-download")
                        with gr.Accordion("Replay a trace (no model runs)", open=False, elem_id="replay-box"):
                            trace_in = gr.File(label="trace file (.json)", file_types=[".json"], type="binary",
                                               elem_id="trace-upload", height=90)
                            with gr.Row():
                                replay_speed = gr.Dropdown(list(th.SPEEDS), value=th.DEFAULT_SPEED,
                                                           label="speed (1× = as recorded)", min_width=120)
                                replay_btn = gr.Button("▶ Replay", elem_id="replay-btn", min_width=80)
                    with gr.Column(scale=9, elem_id="outputs"):
                        gr.HTML(vtok.legend_html(), elem_id="legend")
                        tokens = gr.HTML(vs.tokens_view(studio, []), elem_id="tokens")
                        stats = gr.HTML(vs.stats_view(None, None), elem_id="stats")
                        with gr.Row(equal_height=True, elem_id="plots-row"):
                            with gr.Column(scale=6, min_width=320, elem_id="map-col"):   # the map, then its K nearest
                                map_view = gr.Radio(list(h.MAP_VIEWS), value=h.MAP_VIEWS[0], show_label=False,
                                                    container=False, elem_id="map-zoom")
                                domain_plot = gr.Plot(vs.map_fig(studio, None), show_label=False, elem_id="domain-map")
                                route = gr.HTML(vs.route_view(None), elem_id="route")
                            layer_plot = gr.Plot(vs.layer_fig(studio, None), show_label=False, elem_id="layer-map",
                                                 scale=5, min_width=300)
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
                walk_view = gr.HTML(wh.walk_view(studio, None), elem_id="walk")
            with gr.Tab("Why (not) faster?", id="cost"):
                cost_init, whatif_init = vs.cost_view(studio, None, None)
                cost = gr.HTML(cost_init, elem_id="cost")
                with gr.Row():
                    wi_gamma = gr.Slider(1, 12, value=4, step=1, label="what if: draft length γ")
                    wi_verify = gr.Slider(1.0, 2.5, step=0.01, label="what if: verify cost v (full steps)",
                                          value=round(cal.latency.verify_cost(5), 2) if cal else 1.3)
                what_if_plot = gr.Plot(whatif_init, show_label=False, elem_id="what-if")
            with gr.Tab("Domains & layer sets", id="domains"):
                d_text, d_sets, d_match = vs.domains_views(studio)
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
                gr.Markdown(ABOUT, elem_id="about", latex_delimiters=[{"left": "$$", "right": "$$", "display": True},
                                                                       {"left": "$", "right": "$", "display": False}])

        # --- wiring -------------------------------------------------------------------------------
        # Lanes: only what runs the model holds the model's lane (one at a time), and only while it runs;
        # replay and auto-play pace themselves in lanes of their own. A waiting visitor sees the queue
        # position and Gradio's estimate on the panel the request will fill.
        gen_inputs = [session, prompt, strategy, oracle_domain, max_new, gamma, threshold, temperature, top_p, k,
                      draft, seed]
        gen_outputs = [session, tokens, stats, route, domain_plot, layer_plot, race_view, cost, what_if_plot,
                       trace_dl]
        model_lane = dict(concurrency_limit=1, concurrency_id="model", show_progress="full",
                          show_progress_on=[tokens])
        gen_names = h.GEN_OUTPUTS
        gen_evt = gen_btn.click(wired(h.generate, gen_names, studio), gen_inputs, gen_outputs, api_name="generate",
                                **model_lane)
        sub_evt = prompt.submit(wired(h.generate, gen_names, studio), gen_inputs, gen_outputs, api_visibility="private",
                                **model_lane)
        race_evt = race_btn.click(wired(h.race, gen_names, studio), gen_inputs, gen_outputs, api_name="race",
                                  **model_lane)
        race_static_evt = race_static_btn.click(wired(h.race_static, gen_names, studio), gen_inputs, gen_outputs,
                                                api_name="race_static", **model_lane)
        try_evts = [btn.click(wired(h.pick_example, ("session", "prompt", "oracle_domain"), studio, domain=d),
                              [session], [session, prompt, oracle_domain], queue=False, show_progress="hidden",
                              api_visibility="private")
                    .then(wired(h.race, gen_names, studio), gen_inputs, gen_outputs, api_visibility="private",
                          **model_lane)
                    for d, btn in ex_buttons.items()]
        map_view.change(wired(h.map_zoom, ("session", "domain_plot"), studio), [session, map_view],
                        [session, domain_plot], queue=False, show_progress="hidden", api_visibility="private")
        cal_choice.change(wired(h.choose_calibration, h.CHOOSE_OUTPUTS, studio), [session, cal_choice],
                          [session, route, domain_plot, layer_plot, cost, what_if_plot, domains_md, sets_plot,
                           match_plot, k, cal_info], queue=False, show_progress="hidden", api_name="choose_calibration")
        strategy.change(wired(h.strategy_changed, ["oracle_domain"]), strategy, oracle_domain, queue=False,
                        show_progress="hidden", api_visibility="private")
        replay_evt = replay_btn.click(wired(th.replay, th.REPLAY_OUTPUTS, studio, discard=upload_forgetter()),
                                      [session, trace_in, replay_speed], gen_outputs + [walk_view, prompt],
                                      concurrency_limit=8, concurrency_id="replay", show_progress="hidden",
                                      api_name="replay")
        walk_out, walk_names = [session, walk_view], ("session", "walk")
        w_start.click(wired(wh.walk_start, walk_names, studio), [session, prompt, strategy, oracle_domain, gamma, k],
                      walk_out, api_name="walk_start", concurrency_limit=1, concurrency_id="model",
                      show_progress="full", show_progress_on=[walk_view])
        for btn, phase in ((w_draft, "draft"), (w_verify, "verify"), (w_accept, "accept")):
            btn.click(wired(wh.walk_phase, walk_names, studio, phase=phase), [session], walk_out, queue=False,
                      show_progress="hidden", api_visibility="private")
        w_next.click(wired(wh.walk_next, walk_names, studio), [session], walk_out, queue=False,
                     show_progress="hidden", api_name="walk_next")
        auto_evt = w_auto.click(wired(wh.walk_auto, walk_names, studio), [session], walk_out, concurrency_limit=8,
                                concurrency_id="walk", show_progress="hidden", api_name="walk_auto")
        stop_btn.click(wired(h.stop, ("session", "tokens", "stats"), studio), [session], [session, tokens, stats],
                       cancels=[gen_evt, sub_evt, race_evt, race_static_evt, replay_evt, *try_evts], queue=False, api_name="stop")
        w_stop.click(wired(wh.stop_walk, ["session"]), [session], [session], cancels=[auto_evt], queue=False,
                     api_visibility="private")
        for ctl in (wi_gamma, wi_verify):
            ctl.release(wired(h.what_if, ["what_if"], studio), [session, wi_gamma, wi_verify], what_if_plot,
                        show_progress="hidden", api_visibility="private")
        if admin:               # never on a public server: any registered event can be posted over HTTP
            cal_btn.click(partial(run_calibration, studio), None, [banner, cal_btn], concurrency_limit=1,
                          concurrency_id="model", api_visibility="private")
        fresh = [session, cal_row, banner, strategy, k, domain_plot, layer_plot, cost, what_if_plot, domains_md,
                 sets_plot, match_plot]
        demo.load(wired(h.page_load, h.PAGE_OUTPUTS, studio, cal), [session], fresh, show_progress="hidden",
                  api_visibility="private")

        def generate_text_api(prompt: str, strategy: str = "KNN-SSD", max_new_tokens: float = 64,
                              gamma: float = 4, threshold: float = 0.0, temperature: float = 0.0,
                              top_p: float = 1.0, draft: str = DEFAULT_DRAFT_LABEL, seed: float | None = None,
                              calibration: str = "") -> dict:
            return h.generate_text(studio, prompt, strategy, max_new_tokens, gamma, threshold, temperature, top_p,
                                   draft, seed, calibration)
        gr.api(generate_text_api, api_name="generate_text", concurrency_limit=1, concurrency_id="model")
    return demo


def launch(demo: gr.Blocks, studio: Studio, **kwargs):
    """Queue and serve `demo` under the studio's caps (queue size, upload size, per-visitor requests)."""
    lim = studio.limits
    demo.queue(default_concurrency_limit=4, max_size=lim.queue_size)
    gate_per_visitor(demo._queue, lim.in_flight)
    return demo.launch(css=_css(), head=TOOLTIP_JS, theme=THEME, max_file_size=f"{lim.upload_kb}kb",
                       favicon_path=FAVICON, **kwargs)


def main(argv=None):
    ap = argparse.ArgumentParser(description="KNN-SSD Studio: self-speculative decoding, visualised")
    ap.add_argument("--model", default=None, help="HF id, local folder or .gguf (default: embedded SmolLM2-135M)")
    ap.add_argument("--calibration", default=None,
                    help="calibration folder (default: assets/calibration/<model slug>)")
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
    studio = startup.load_studio(args.model, args.calibration, threads=args.threads, map_in_background=True,
                                 device=args.device, limits=limits, warm=False)
    t_ui = time.perf_counter()
    # the UI builds while the warm-up decode runs (its torch work releases the GIL): ~1.4 s less start-up
    warming = threading.Thread(target=startup.warm_up, args=(studio,), name="warm-up", daemon=True)
    warming.start()
    demo = build(studio)
    warming.join()
    t = studio.timings
    where = f"loaded from {studio.cal_folder}" if studio.calibration else studio.cal_error
    print(f"start-up ({'cold: first run converts the GGUF' if t['cold'] else 'warm: model from cache'}): "
          f"{time.perf_counter() - T_LAUNCH:.1f} s (imports {imports_s:.1f} s, model {t['model_s']} s, "
          f"calibration {t['ready_s'] - t['model_s']:.1f} s, warm-up beside the UI build "
          f"{time.perf_counter() - t_ui:.1f} s; the UMAP domain map loads in the background); "
          f"calibration: {where}", flush=True)
    print(f"caps ({'public Space' if limits.public else 'local'}): {limits.describe()}", flush=True)
    launch(demo, studio, prevent_thread_lock=True)
    studio.start_map()              # the UMAP map compiles in the background once the server is up
    demo.block_thread()


if __name__ == "__main__":
    main()
