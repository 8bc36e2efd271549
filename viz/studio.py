"""The app's shared resources and request checks, without Gradio: the Studio (model, calibration,
figures), loading it, the committed benchmark results, the settings' limits and their validation.

The app (app.py), the handlers (viz.handlers, viz.walk_handlers) and the tests import these.
"""
from __future__ import annotations

import os

# numba (UMAP) would otherwise load a second OpenMP runtime beside torch's, in a thread that runs while
# torch decodes at start-up; its own work-queue layer is enough for placing one point at a time.
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

import logging
import threading
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ssd_core import calibration as cal_io
from ssd_core.calibration.domains import load_prompts, split
from ssd_core.engine.decode import DecodeConfig
from ssd_core.engine.loading import load_backbone
from ssd_core.policies import registry
from ssd_core.policies.ar import Autoregressive
from viz import domain_map as vmap
from viz.benchmark import bench_plots, read_bench  # noqa: F401  (app.py and the tests import them from here)

log = logging.getLogger("knn-ssd-studio")
ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "assets" / "bench"
# the strategies the UI offers, in its order; names and labels come from the one registry
UI_ORDER = ("knn", "static", "knapspec", "oracle", "ar")
LABELS = registry.LABELS
STRATEGIES = {LABELS[n]: n for n in UI_ORDER}          # UI label → strategy name
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
PLOT_H = 310                  # the layer map, as tall as the domain map and its K-nearest list
MAP_H = 190                   # the domain map: the K-nearest list sits under it, beside the layer map
QUICK_CALIBRATION = dict(budget=8, prompts_per_domain=4, held_out_per_domain=3)
_KEEP = object()


@dataclass(frozen=True)
class Update:
    """A change to one output beyond its value (visibility, whether it can be used); the app turns it
    into gr.update."""

    value: object = _KEEP
    visible: bool | None = None
    interactive: bool | None = None

    def changes(self) -> dict:
        out = {} if self.value is _KEEP else {"value": self.value}
        return {**out, **{k: v for k, v in (("visible", self.visible), ("interactive", self.interactive))
                          if v is not None}}


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
    start_map: Callable[[], None] = lambda: None    # set by load_studio(map_in_background=True)
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


def load_map(cal) -> tuple[object | None, str]:
    try:
        dm = cal.load_domain_map()
        dm.warm()
        return dm, ""
    except Exception as exc:        # umap unusable or file changed: the app works without the map
        return None, f"domain map unavailable: {exc}"


def load_studio(spec: str | None = None, calibration: str | Path | None = None, threads: int = 2,
                warm: bool = True, backbone=None, map_in_background: bool = False, device="auto") -> Studio:
    """Load model and calibration; the UMAP domain map is not needed for the first token.

    device: where a model loaded here runs (auto|cpu|cuda, or a torch.device); a given backbone stays put.

    map_in_background: return without the map; `studio.start_map()` then loads it in a thread that
    installs it when done (the map panel says "loading" until then). umap's first import compiles with
    numba for ~15 s on two cores, so app.py starts it once the server is up: beside the UI build it
    made the start-up slower.
    """
    t0 = time.perf_counter()
    folder = Path(calibration) if calibration else cal_io.default_folder(spec)
    from ssd_core.engine import loading as core_bb
    cold = backbone is None and not core_bb.model_cache_ready(spec)
    bb = backbone or load_backbone(spec, threads=threads, device=device)
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
        dm, err = load_map(cal)
        if studio.calibration is cal:      # not replaced by a calibration run meanwhile
            studio.install(cal, dm, err)
        studio.timings["map_s"] = round(time.perf_counter() - t, 1)

    if cal is not None:
        if map_in_background:
            studio.start_map = threading.Thread(target=prepare_map, name="domain-map", daemon=True).start
        else:
            prepare_map()
    return studio


def warm_up(studio: Studio) -> None:
    """One short decode and one of each figure, so a visitor's first click pays no first-call costs."""
    from viz.handlers import generate
    prompt = next(iter(studio.examples.values()))[0]
    for _ in generate(studio, None, prompt, "KNN-SSD", None, 6, 3, 0.0, 0.0, 1.0, 5):
        pass


def public_message(text: str) -> str:
    """A message fit for a public page: no absolute file-system paths."""
    text = text.replace(str(ROOT) + "/", "").replace(str(ROOT), ".")
    return text.replace(str(Path.home()), "~")


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


def clean_prompt(prompt) -> str:
    """Drop control characters (keeping newlines and tabs); emoji, RTL and CJK text pass as they are."""
    if not isinstance(prompt, str):
        return ""
    return "".join(c for c in prompt if c in "\n\t" or unicodedata.category(c) not in ("Cc", "Cs"))


def problem(prompt: str, make) -> tuple[str, object]:
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
