"""The app's shared resources and request checks, without Gradio: the Studio (model, calibration,
figures), loading it, the committed benchmark results, the settings' limits and their validation.

The app (app.py), the handlers (viz.handlers, viz.walk_handlers) and the tests import these.
"""
from __future__ import annotations

import dataclasses
import os
import secrets

# numba (UMAP) would otherwise load a second OpenMP runtime beside torch's, in a thread that runs while
# torch decodes at start-up; its own work-queue layer is enough for placing one point at a time.
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

import logging
import re
import threading
import unicodedata
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ssd_core.calibration.profiles import Quiet
from ssd_core.engine.decode import DecodeConfig
from ssd_core.policies import registry
from ssd_core.policies.ar import Autoregressive
from viz import domain_map as vmap
from viz.limits import Limits

log = logging.getLogger("knn-ssd-studio")
ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "assets" / "bench"
# the strategies the UI offers, in its order; names and labels come from the one registry
UI_ORDER = ("knn", "static", "knapspec", "oracle", "ar")
LABELS = registry.LABELS
STRATEGY_OF_LABEL = {LABELS[n]: n for n in UI_ORDER}          # UI label → strategy name
MAX_PROMPT_TOKENS = 1024        # longer prompts are shortened (head + tail) with a visible notice
MAX_PROMPT_CHARS = 100_000      # request size limit: beyond this we refuse instead of tokenising
MAX_NEW_TOKENS = 512           # the most any server allows; a Space allows fewer (viz.limits)
# Models a public Space may serve (never arbitrary paths, never trust_remote_code).
ALLOWED_MODELS = (None, "smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-360M-Instruct",
                  "Qwen/Qwen2.5-0.5B-Instruct")
# the draft's weights, as offered in the UI: (DecodeConfig.draft, DecodeConfig.lookup)
DRAFTS = {"int8 + prompt lookup": ("int8", True), "int8": ("int8", False),
          "fp32 + prompt lookup": ("fp32", True), "fp32 (layer skipping only)": ("fp32", False)}
DEFAULT_DRAFT_LABEL = "int8 + prompt lookup"
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
class Choice:
    """A calibration a visitor may pick (viz.startup.load_choices): loaded once, shared by every visitor
    who picks it; its draft weights come from the one backbone's draft factory, built once."""

    name: str                       # its folder's name: what a session and the API name it by
    title: str                      # a few words: the chooser's entry
    line: str                       # one line under the chooser: what its domains draft with, its bench speed
    calibration: object
    folder: Path
    domain_map: object | None = None
    anchors: list = field(default_factory=list)
    map_error: str = "domain map loading …"


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
    start_map: Callable[[], None] = lambda: None    # set by viz.startup.load_studio(map_in_background=True)
    limits: Limits = field(default_factory=Limits)  # what one visitor may ask of this server
    lock: threading.Lock = field(default_factory=threading.Lock)
    uploads: OrderedDict = field(default_factory=OrderedDict)   # upload path → parsed Trace (viz.trace_handlers)
    # the calibrations a visitor may pick, the served one first (name → Choice; empty: no chooser)
    choices: dict = field(default_factory=dict)
    # visitors' model jobs vs background measurements: never at the same time (profiles.Quiet)
    quiet: Quiet = field(default_factory=Quiet)
    # the serving engine every visitor's decode goes through, stepped in one batch (viz.startup.start_engine;
    # None: each decode runs alone on its caller's thread, as in the tests and the benchmark)
    engine: object | None = None

    def for_visitor(self, name: str | None) -> "Studio":
        """This studio as a visitor who picked calibration `name` sees it: the same model, caps and
        locks, that calibration and its domain map. The served one (or an unknown name): the studio itself."""
        c = self.choices.get(name) if name else None
        if c is None or c.calibration is self.calibration:
            return self
        return dataclasses.replace(self, calibration=c.calibration, cal_folder=c.folder, domain_map=c.domain_map,
                                   anchors=c.anchors, map_error=c.map_error)

    def draft_memory(self) -> str:
        """The draft weights built so far, in words (what serving the chosen calibrations costs in memory)."""
        mem = self.backbone.drafts.memory()
        return (f"draft weights in memory: {sum(mem.values()) / 1e6:.0f} MB ({len(mem)} "
                f"draft{'s' if len(mem) != 1 else ''} built, shared by every visitor)")

    def install(self, cal, domain_map=None, map_error: str = "") -> None:
        """Swap in a (new) calibration and its domain map for every session."""
        anchors = map_anchors(cal, domain_map)
        with self.lock:
            self.calibration, self.cal_error = cal, ""
            self.domain_map, self.anchors, self.map_error = domain_map, anchors, map_error

    def install_map(self, choice: Choice, domain_map=None, map_error: str = "") -> None:
        """A chosen calibration's domain map, once loaded (the served one's: `install`)."""
        anchors = map_anchors(choice.calibration, domain_map)
        with self.lock:
            choice.domain_map, choice.anchors, choice.map_error = domain_map, anchors, map_error


def map_anchors(cal, domain_map) -> list:
    """The domain map's anchor traces of a calibration ([] without a map)."""
    if domain_map is None:
        return []
    r = cal.router
    return vmap.anchor_traces(domain_map.coords, r.domains, r.texts, r.kinds)


def public_message(text: str) -> str:
    """A message fit for a public page: no absolute file-system paths (the repo's become relative, the
    home's `~`, any other becomes …)."""
    text = text.replace(str(ROOT) + "/", "").replace(str(ROOT), ".").replace(str(Path.home()), "~")
    return re.sub(r"(?<![\w.~])/(?:[\w.-]+/)+[\w.-]*", "…", text)


# --- building a request -----------------------------------------------------------------------------
def make_config(max_new, gamma, threshold, temperature, top_p, draft=DEFAULT_DRAFT_LABEL, seed=None,
                max_new_cap: int = MAX_NEW_TOKENS) -> DecodeConfig:
    """Settings from the UI or the API; anything out of range raises ValueError with a message.

    seed: sampling's seed; None or blank draws a fresh one for this request (so two visitors who sample
    do not get the same text), and the run's trace records it so the run can be repeated.
    max_new_cap: this server's cap on new tokens (viz.limits)."""
    if not 1 <= float(max_new) <= max_new_cap:
        raise ValueError(f"max new tokens must be between 1 and {max_new_cap} on this server")
    if draft not in DRAFTS:
        raise ValueError(f"draft must be one of: {', '.join(DRAFTS)}")
    kind, lookup = DRAFTS[draft]
    return DecodeConfig(max_new_tokens=int(max_new), gamma=int(gamma), threshold=float(threshold),
                        temperature=float(temperature), top_p=float(top_p), seed=make_seed(seed),
                        max_prompt_tokens=MAX_PROMPT_TOKENS, draft=kind, lookup=lookup)


def make_seed(seed) -> int:
    """A sampling seed: the visitor's (a whole number 0..2**31-1), or a fresh random one when left blank."""
    if seed is None or (isinstance(seed, str) and not seed.strip()):
        return secrets.randbelow(2 ** 31)
    value = float(seed)
    if not (value.is_integer() and 0 <= value < 2 ** 31):
        raise ValueError("seed must be a whole number from 0 to 2147483647 (or blank for a random one)")
    return int(value)


def safe_k(k) -> int:
    """K, the number of neighbours the router votes with: a whole number in 1..50."""
    if not 1 <= float(k) <= 50:
        raise ValueError("K (neighbours) must be between 1 and 50")
    return int(k)


def make_strategy(studio: Studio, name: str, gamma: int, k: int, domain: str | None, draft: str = "int8"):
    cal = studio.calibration
    if cal is None or name == "ar":
        return Autoregressive()
    return registry.build(cal, name, gamma=int(gamma), k=int(k), domain=domain or None, draft=draft)


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
