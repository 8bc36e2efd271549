"""Starting the app, without Gradio: load the model and its calibration into a Studio, warm it up, load the
UMAP domain map in the background, and (an admin action, never a public event) calibrate from scratch.

It sits above viz.studio (shared resources) and viz.handlers (the events): the warm-up runs a real
Generate through the handler, so the first visitor pays no first-call costs.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from pathlib import Path

from ssd_core import calibration as cal_io
from ssd_core.calibration.domains import load_prompts, split
from ssd_core.calibration import profiles
from ssd_core.engine import loading as core_loading
from ssd_core.engine.decode import DecodeConfig
from ssd_core.engine.goodput import GoodputRule, costs_for_machine
from ssd_core.engine.serve import Engine
from viz.handlers import generate
from viz.limits import Limits
from viz.session import banner
from viz.benchmark import read_bench, runs_of_calibration
from viz.studio import BENCH_DIR, QUICK_CALIBRATION, Choice, Studio, Update, public_message

log = logging.getLogger("knn-ssd-studio")


def load_map(cal) -> tuple[object | None, str]:
    """(the calibration's UMAP domain map, "") or (None, the public words for why not). The words go into
    every visitor's map title, so they carry no detail (an exception's text can name a server path): the
    detail goes to the server log."""
    try:
        dm = cal.load_domain_map()
        dm.warm()
        return dm, ""
    except Exception as exc:        # umap unusable or file changed: the app works without the map
        log.warning("domain map unavailable for %s: %s: %s", getattr(cal, "folder", "?"), type(exc).__name__, exc)
        return None, MAP_UNAVAILABLE


MAP_UNAVAILABLE = "domain map unavailable (see the server log)"


SOURCE_WORDS = {"cache": "measured on this machine at an earlier start",
                "committed": "a committed profile of this CPU",
                "measured": "measured on this machine after this app's start, on an idle engine"}


def _install_latency(cal, lat, source: str) -> None:
    cal.latency = dataclasses.replace(lat, machine={**lat.machine, "source": SOURCE_WORDS.get(source, source)})


def known_latency(studio: Studio, cals) -> list:
    """At load, before any visitor: give each calibration (with its folder) this machine's latency model
    where one is known without measuring — its own, the cache's, a committed one (ssd_core.calibration.
    profiles.known) — and mark the others provisional. Returns the calibrations still to measure."""
    todo = []
    for cal, folder in cals:
        lat, source = profiles.known(studio.backbone, cal, folder)
        if lat is None:
            cal.latency = profiles.provisional(cal.latency, source)
            todo.append(cal)
        elif source != "calibration":
            _install_latency(cal, lat, source)
    return todo


def measure_latency(studio: Studio, todo) -> None:
    """Measure this machine's latency model on an idle engine (each timing in a Quiet slice between
    visitors' jobs; ~10 s of idle time for SmolLM2-135M on 2 cores), cache it, and install it in every
    calibration in `todo` (they draft from the one backbone and draft head)."""
    if not todo:
        return
    t = time.perf_counter()
    fresh = profiles.measure(studio.backbone, turn=studio.quiet.slice)
    for cal in todo:
        _install_latency(cal, fresh, "measured")
    studio.timings["latency_s"] = round(time.perf_counter() - t, 1)


def off_main(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a thread of its own (its result, or its exception re-raised here). torch's
    OpenMP workers are made per thread that starts parallel work; once the main thread had, each other
    thread's parallel work ran ~30% slower on this 2-core AMD EPYC (a 16×576 by 576×1536 matmul: 262 µs on a
    fresh thread, 373 µs on a thread after the main one had run it). The app keeps torch off its main thread."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:     # noqa: BLE001 - re-raised on the caller's thread
            out["error"] = exc
    t = threading.Thread(target=run, name=getattr(fn, "__name__", "off-main"))
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def start_engine(studio: Studio) -> Engine:
    """Serve every visitor from one batch: the engine's thread owns the model's passes from now on, and each
    `decode()` a handler starts joins its running batch (engine.serve), within the caps' rows and KV memory;
    the goodput rule sets the draft length of each shared step. Call after the warm-up (it runs the model
    directly); the tests leave it out, so their decodes run alone on their own thread."""
    lim = studio.limits
    studio.engine = Engine(studio.backbone, max_rows=lim.max_rows, kv_budget_mb=lim.kv_budget_mb,
                           rule=GoodputRule(studio.backbone)).attach()
    return studio.engine


def measure_batch_costs(studio: Studio) -> None:
    """This machine's packed-pass costs for the goodput rule (~6 s of idle engine, cached; until then its
    built-in ones, marked provisional), timed in Quiet slices between visitors' jobs like the latency model."""
    rule = getattr(studio.engine, "rule", None)
    if rule is None:
        return
    t = time.perf_counter()
    rule.costs = costs_for_machine(studio.backbone, turn=studio.quiet.slice)
    studio.timings["batch_costs_s"] = round(time.perf_counter() - t, 1)


def describe_choice(name: str, cal, served: bool) -> tuple[str, str]:
    """(title, line) for the calibration chooser: a few words, and one line on what its domains draft
    with and, when a committed held-out bench ran it as it is, how fast knn and static were there."""
    sets = cal.domain_sets
    own = sum(not s.same_draft(cal.static) for s in sets.values())
    kind = "channel sets" if any(s.channels for s in [*sets.values(), cal.static]) else "layer sets"
    short = "served default" if served else name.removeprefix(cal_io.model_slug_of(cal) + "-")
    if own == 0:
        title = f"{short} · one {kind[:-1]} for every domain"
        what = f"{kind}: every domain drafts with the one static set, so routing changes nothing"
    else:
        title = f"{short} · KNN-SSD {kind}"
        what = f"KNN-SSD {kind}: {own} of {len(sets)} domains draft with a set of their own"
    runs = runs_of_calibration(BENCH_DIR, name, cal.meta.get("created"))
    speed = ""
    if runs:
        st = runs[0].get("strategies", {})
        knn, static = st.get("knn", {}).get("speedup"), st.get("static", {}).get("speedup")
        if knn and static:
            speed = f" · last held-out bench: knn {knn:.2f}×, static {static:.2f}× plain decoding"
    return title, f"{name}{' (served)' if served else ''} · {what}{speed}"


def load_choices(studio: Studio, root: Path | None = None) -> None:
    """The calibrations a visitor may pick: the served one first, then every other one under
    assets/calibration/ made for this model that can draft from the same backbone beside it
    (artifact.shares_backbone). Quick (≈ 0.05 s each): their domain maps load in the background."""
    served, bb = studio.calibration, studio.backbone
    if served is None:
        return
    folder = Path(studio.cal_folder)
    choices = {folder.name: Choice(folder.name, *describe_choice(folder.name, served, True), served, folder)}
    for other in sorted(Path(root or cal_io.CALIBRATION_ROOT).glob("*/calibration.json")):
        other = other.parent
        if other.resolve() == folder.resolve() or other.name in choices:
            continue
        try:
            cal = cal_io.load(other, bb, install=False)
        except cal_io.CalibrationError as exc:       # another model's, or out of date: not offered
            log.info("calibration %s not offered: %s", other.name, exc)
            continue
        why = cal_io.shares_backbone(cal, bb)
        if why:
            log.info("calibration %s not offered: %s", other.name, why)
            continue
        choices[other.name] = Choice(other.name, *describe_choice(other.name, cal, False), cal, other)
    studio.choices = choices


def prebuild_drafts(studio: Studio) -> None:
    """Build every chosen calibration's draft weights now, in the background, so that the first visitor
    who picks one pays nothing (a channel set's cut MLPs: ~0.5 s each on 2 cores)."""
    cfg = DecodeConfig()
    for c in studio.choices.values():
        for s in {(s.channels, s.keep): s for s in [*c.calibration.domain_sets.values(), c.calibration.static]
                  if s.channels}.values():
            studio.backbone.drafts.get(cfg.draft, cfg.small_head, s)


def load_studio(spec: str | None = None, calibration: str | Path | None = None, threads: int = 2,
                warm: bool = True, backbone=None, map_in_background: bool = False, device="auto",
                limits: Limits | None = None) -> Studio:
    """Load model and calibration; the UMAP domain map is not needed for the first token.

    device: where a model loaded here runs (auto|cpu|cuda, or a torch.device); a given backbone stays put.

    map_in_background: return without the map; `studio.start_map()` then loads it in a thread that
    installs it when done (the map panel says "loading" until then). umap's first import compiles with
    numba for ~15 s on two cores, so app.py starts it once the server is up: beside the UI build it
    made the start-up slower.
    """
    t0 = time.perf_counter()
    folder = Path(calibration) if calibration else cal_io.default_folder(spec)
    cold = backbone is None and not core_loading.model_cache_ready(spec)
    bb = backbone or core_loading.load_backbone(spec, threads=threads, device=device)
    t_model = time.perf_counter() - t0
    prompts = load_prompts()
    examples = {d: split(p)[1] or p for d, p in prompts.items()}
    studio = Studio(bb, spec, folder, examples, read_bench(BENCH_DIR), limits=limits or Limits.resolve())
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

    if cal is not None:
        load_choices(studio)
    others = [c for c in studio.choices.values() if c.calibration is not cal]
    to_measure = known_latency(studio, [(cal, folder)] + [(c.calibration, c.folder) for c in others]) if cal else []

    def prepare_map():
        # first this machine's latency model, measured between visitors' jobs while nothing else runs
        if to_measure:
            why = to_measure[0].latency.machine["provisional"]
            measure_latency(studio, to_measure)
            if map_in_background:
                print(f"latency model measured on this machine in {studio.timings['latency_s']} s on an idle "
                      f"engine and cached ({why})", flush=True)
        # and the batched passes' costs the goodput rule prices shared steps with (with an engine serving)
        if studio.engine is not None:
            measure_batch_costs(studio)
            if map_in_background:
                print(f"batched pass costs for the goodput rule ready after {studio.timings['batch_costs_s']} s "
                      "(measured on an idle engine, or this machine's cached ones)", flush=True)
        # then the heavy start-up work (UMAP's numba compile, draft builds) yields the CPU to visitors
        lower_priority()
        t = time.perf_counter()
        dm, err = load_map(cal)
        if studio.calibration is cal:      # not replaced by a calibration run meanwhile
            studio.install(cal, dm, err)
        studio.timings["map_s"] = round(time.perf_counter() - t, 1)
        if map_in_background:           # the server is up meanwhile: say when the map is there too
            print(f"domain map {'ready' if dm is not None else 'unavailable'} after {studio.timings['map_s']} s",
                  flush=True)
        for c in others:
            studio.install_map(c, *load_map(c.calibration))
        prebuild_drafts(studio)
        if map_in_background and others:
            print(f"calibrations a visitor may pick: {', '.join(studio.choices)}; {studio.draft_memory()}",
                  flush=True)

    if cal is not None:
        if map_in_background:
            studio.start_map = threading.Thread(target=prepare_map, name="domain-map", daemon=True).start
        else:
            prepare_map()
    return studio


def lower_priority() -> None:
    """The calling thread (and threads it starts) at the lowest CPU priority (Linux: a thread is a task
    with a nice value of its own), so background start-up work slows visitors' decoding as little as
    the kernel allows; a no-op where that is not possible."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def warm_up(studio: Studio) -> None:
    """One short decode and one of each figure, so a visitor's first click pays no first-call costs."""
    prompt = next(iter(studio.examples.values()))[0]
    for _ in generate(studio, None, prompt, "KNN-SSD", None, 6, 3, 0.0, 0.0, 1.0, 5):
        pass
    # every verification length the default γ gives: a kernel's first call at a new pass shape sets it
    # up (oneDNN builds a primitive per shape), and the lap that met it first would pay for it in a race
    bb = studio.backbone
    cache = bb.new_cache(64 + VERIFY_ROWS)
    cache.length = 64
    for rows in range(2, VERIFY_ROWS + 1):
        bb.forward([1] * rows, cache, logits="all")
        cache.crop(64)


VERIFY_ROWS = 5           # the default γ (4) drafts + the verifier's own token; longer passes set up on first use


def run_calibration(studio: Studio, progress) -> dict:
    """Build a quick calibration for the loaded model (tqdm bars show as a progress bar), then load it.

    An admin action: app.py registers it as an event only on a private server with no calibration
    (loopback, not a Space); on a public server calibration is the command line's job."""
    from ssd_core.calibration.build import CalibrationSettings, calibrate   # lazy: not needed to serve
    progress(0, desc="calibrating (latency profile, skip-set search, router, UMAP)")
    try:
        cal = calibrate(studio.spec, studio.cal_folder, CalibrationSettings(**QUICK_CALIBRATION),
                        backbone=studio.backbone, progress=True)
    except Exception as exc:
        return dict(banner=Update(value=banner(f"Calibration failed: {exc}"), visible=True),
                    cal_btn=Update(visible=True))
    dm, err = load_map(cal)
    studio.install(cal, dm, err)
    return dict(banner=Update(value=banner(f"Calibration written to {studio.cal_folder} and loaded: reload the "
                                           "page to draft with it.", ok=True), visible=True),
                cal_btn=Update(visible=False))
