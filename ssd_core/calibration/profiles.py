"""The latency model of the machine that runs: committed, cached or measured — and measured quietly.

A calibration carries the latency model of the CPU it was profiled on. On another CPU (or thread
count, device, verifier kernel) those costs are wrong: kernel rankings flip between machines. This
module finds the right one, in order:

1. the calibration's own, when it describes this machine (LatencyModel.stale_for is None);
2. one measured here before, cached outside the project (`machine.cache_dir()/latency/<key>.json`,
   keyed by CPU, threads, torch, device, verifier kernel, model shape and draft head);
3. one committed for this CPU beside the calibration (`<calibration>/profiles/*.json`), which seeds a
   fresh machine — a free Space restarts with an empty home;
4. else it is measured now (`measure`), on a quiet engine: `profile(turn=...)` takes each timing in a
   slice granted by `Quiet.slice`, which waits until no visitor's model job runs. Measured under load
   (beside the start-up's UMAP compile and draft builds) the int8 draft read c = 0.69 of a step where
   runs measured 0.19–0.48: timing noise on a shared CPU only ever adds time, and it adds most to the
   shortest passes.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..engine.device import device_label
from ..engine.machine import cache_dir, cpu_info
from .latency import LatencyModel, check, profile

log = logging.getLogger(__name__)

PROFILE_DIR = "profiles"          # committed profiles beside a calibration, one per CPU measured
# the way latency.profile measures; a change makes cached profiles stale (2: verify at the shortest
# context, no running-maximum correction)
PROFILE_METHOD = 2


def profile_key(bb) -> str:
    """What a latency model depends on besides the calibration's sets: the machine, the kernels, the
    model's shape and the draft head it drafts with."""
    head = bb.drafts.head_ids
    shape = (bb.n_layers, bb.hidden, bb.layers[0].wdown.shape[1], bb.vocab, str(bb.dtype),
             len(head) if head else None)
    text = json.dumps([PROFILE_METHOD, cpu_info(), torch.__version__, device_label(bb.device), bb.kernel, shape],
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache_file(bb) -> Path:
    return cache_dir() / "latency" / f"{profile_key(bb)}.json"


def _read(path: Path) -> LatencyModel | None:
    try:
        return LatencyModel.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def cached(bb) -> LatencyModel | None:
    """The latency model measured on this machine before (None: none, or it does not fit any more)."""
    lat = _read(_cache_file(bb))
    return lat if lat is not None and lat.stale_for(bb) is None else None


def committed(bb, folder: Path | str | None) -> LatencyModel | None:
    """A committed profile of this machine beside the calibration in `folder` (None: none fits)."""
    if folder is None:
        return None
    for path in sorted(Path(folder, PROFILE_DIR).glob("*.json")):
        lat = _read(path)
        if lat is not None and lat.stale_for(bb) is None:
            return lat
    return None


def save(bb, lat: LatencyModel, path: Path | None = None) -> Path:
    path = path or _cache_file(bb)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(lat.to_dict()))
    tmp.replace(path)
    return path


def known(bb, cal, folder=None) -> tuple[LatencyModel | None, str]:
    """(this machine's latency model without measuring, where it came from); (None, why) when it must
    be measured."""
    why = cal.latency.stale_for(bb)
    if why is None:
        return cal.latency, "calibration"
    lat = cached(bb)
    if lat is not None:
        return lat, "cache"
    lat = committed(bb, folder)
    if lat is not None:
        return lat, "committed"
    return None, why


def measure(bb, turn=None, progress: bool = False, tries: int = 3, tolerance: float = 0.20) -> LatencyModel:
    """Profile this machine now (each timing inside `turn()`, when given) and cache the result. A fresh
    full step timed after the profile must agree with the profile's own timing of it within `tolerance`,
    else the machine changed state meanwhile (another process) and it is profiled again, up to `tries`
    times. (Back-to-back profiles on this 2-core VM differ by up to ±17%; a burst of another process read
    +30%.)"""
    t = time.perf_counter()
    for attempt in range(1, tries + 1):
        lat = profile(bb, progress=progress, turn=turn)
        agreement = check(bb, lat, turn=turn)
        if abs(agreement - 1.0) <= tolerance:
            break
        log.warning("latency profile %d disagrees with a fresh step by %+.0f%%: measuring again", attempt,
                    100 * (agreement - 1))
    lat = dataclasses.replace(lat, machine={**lat.machine, "measured_at": datetime.now(timezone.utc).isoformat(
        timespec="seconds"), "profile_s": round(time.perf_counter() - t, 1), "attempts": attempt,
        "check": round(agreement, 3)})
    try:
        save(bb, lat)
    except OSError as exc:                 # a read-only home: measured again next start
        log.warning("latency model not cached: %s", exc)
    return lat


def provisional(lat: LatencyModel, why: str) -> LatencyModel:
    """`lat` marked as not describing this machine yet (the cost panel says so until it is measured)."""
    return dataclasses.replace(lat, machine={**lat.machine, "provisional": why})


def for_machine(bb, cal, folder=None, turn=None, progress: bool = False) -> tuple[LatencyModel, str]:
    """This machine's latency model: known (calibration, cache, committed) or measured now."""
    lat, source = known(bb, cal, folder)
    if lat is not None:
        return lat, source
    return measure(bb, turn=turn, progress=progress), "measured"


class Quiet:
    """Visitors' model jobs and background measurements never overlap: a measurement slice starts only
    when no job has run for `idle_s`, and a job that arrives during a slice waits for that slice to
    end (one timing: a few hundred ms). Jobs never wait for each other here."""

    def __init__(self, idle_s: float = 0.5):
        self.idle_s = idle_s
        self._cv = threading.Condition()
        self._jobs = 0
        self._measuring = False
        self._last_job = 0.0

    @contextmanager
    def job(self):
        """Around a visitor's model work (a generator may hold it across yields)."""
        with self._cv:
            while self._measuring:
                self._cv.wait(timeout=5.0)
            self._jobs += 1
        try:
            yield
        finally:
            with self._cv:
                self._jobs -= 1
                self._last_job = time.monotonic()
                self._cv.notify_all()

    @contextmanager
    def slice(self):
        """Around one background timing: waits for an idle engine, then holds new jobs back until done."""
        with self._cv:
            while self._jobs or time.monotonic() - self._last_job < self.idle_s:
                self._cv.wait(timeout=max(0.05, self.idle_s - (time.monotonic() - self._last_job)))
            self._measuring = True
        try:
            yield
        finally:
            with self._cv:
                self._measuring = False
                self._cv.notify_all()
