"""The machine the core runs on, and which matmul kernel is fastest on it, measured and cached.

The CPU differs between machines of one kind (an AMD EPYC with AVX2 only, an Intel Xeon with AVX-512),
and kernel rankings flip between them: on one Xeon the oneDNN-prepacked fp32 weights verify five rows
~1.9× faster than `F.linear` but decode one row ~1.3× slower. So the verifier's kernel is chosen per
pass shape (one row: plain decoding, a draft's fp32 pass; several rows: verification and prefill) by
timing both on this machine, once, and the choice is cached outside the project (`cache_dir()`, keyed
by CPU model, instruction-set flags, threads, torch version and model shape).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from .cpuinfo import VECTOR_FLAGS, read_cpuinfo

log = logging.getLogger(__name__)

KERNEL_FLAGS = VECTOR_FLAGS          # recorded with every choice and every latency profile
KERNELS = ("plain", "onednn", "split")   # Backbone.set_kernel
CHOICE_FILE = "kernels.json"


def cache_dir() -> Path:
    """Where the core caches what it measures or converts (never under assets/): $KNN_SSD_CACHE or
    ~/.cache/knn-ssd-studio."""
    return Path(os.environ.get("KNN_SSD_CACHE", Path.home() / ".cache" / "knn-ssd-studio"))


def cpu_info() -> dict:
    """{"model": the CPU's name, "flags": the KERNEL_FLAGS it has, "threads": torch's intra-op threads}."""
    model, flags = read_cpuinfo()
    return {"model": model or platform.processor() or platform.machine(),
            "flags": [f for f in KERNEL_FLAGS if f in flags], "threads": torch.get_num_threads()}


def same_cpu(a: dict | None, b: dict | None) -> bool:
    """Whether two cpu_info records describe the same CPU and thread count (None: unknown → False)."""
    if not a or not b:
        return False
    return all(a.get(k) == b.get(k) for k in ("model", "flags", "threads"))


def cpu_words(info: dict | None) -> str:
    """A cpu_info record in words: "Intel(R) Xeon(R) Processor @ 2.80GHz (avx2, avx512f, …; 2 threads)"."""
    if not info:
        return "an unrecorded CPU"
    flags = ", ".join(info.get("flags") or []) or "no listed vector flags"
    return f"{info.get('model') or 'unknown CPU'} ({flags}; {info.get('threads')} threads)"


def release_freed_memory() -> None:
    """Hand memory that was freed back to the OS (glibc's malloc_trim; nothing elsewhere). Building drafts
    makes large fp32 temporaries in two threads; their arenas otherwise keep the pages, and the 8 cut MLP
    sets of the channel calibration left the app's RSS 1.2 GB higher for 0.3 GB of live draft weights."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# --- the verifier's kernel per pass shape ------------------------------------------------------------
def _choice_key(backbone) -> str:
    shape = (backbone.n_layers, backbone.hidden, backbone.layers[0].wdown.shape[1], backbone.vocab,
             str(backbone.dtype))
    text = json.dumps([cpu_info(), torch.__version__, shape, KERNELS], sort_keys=True)   # a new kernel: measure again
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def measure_kernels(backbone, rows=(1, 5), context: int = 64, repeats: int = 7) -> dict:
    """Seconds (median of `repeats`, kernels interleaved so drift hits both) of one forward of `rows`
    tokens at `context` under each kernel: {rows: {kernel: s}}."""
    before = backbone.kernel
    cache = backbone.new_cache(context + max(rows) + 1)
    cache.k.fill_(0.0), cache.v.fill_(0.0)            # fault every page in before the clock
    times = {r: {k: [] for k in KERNELS} for r in rows}
    for i in range(repeats + 1):                      # the first round warms both up and is dropped
        for r in rows:
            for k in KERNELS:
                backbone.use_kernels(k, k, keep_packed=True)
                cache.length = context
                t = time.perf_counter()
                backbone.forward(list(range(1, r + 1)), cache, logits="all" if r > 1 else "last")
                if i:
                    times[r][k].append(time.perf_counter() - t)
    if before:                                        # put back the kernels it ran on before
        one, _, many = before.partition("/")
        backbone.use_kernels(one, many or one)
    return {r: {k: statistics.median(v) for k, v in by.items()} for r, by in times.items()}


def fastest_kernels(backbone, refresh: bool = False) -> tuple[str, str]:
    """(one-row kernel, several-rows kernel) fastest for this backbone on this machine: cached, or
    measured now (≈ 2 s for SmolLM2-135M on 2 cores) and cached. refresh: measure again."""
    def measure():
        timing = measure_kernels(backbone)
        choice = [min(timing[r], key=timing[r].get) for r in sorted(timing)]
        return choice, {str(r): {k: round(1000 * s, 3) for k, s in by.items()} for r, by in timing.items()}
    valid = lambda c: isinstance(c, list) and len(c) == 2 and all(k in KERNELS for k in c)   # noqa: E731
    return tuple(_cached_choice(_choice_key(backbone), backbone, measure, valid, "verifier", refresh))


def _cached_choice(key: str, backbone, measure, valid, what: str, refresh: bool):
    """The choice cached under `key` in kernels.json, or `measure()` → (choice, timings) now, cached."""
    path = cache_dir() / CHOICE_FILE
    entry = _read(path).get(key)
    if not refresh and isinstance(entry, dict) and valid(entry.get("choice")):
        return entry["choice"]
    t = time.perf_counter()
    choice, timings = measure()
    log.info("%s kernel choice measured in %.1f s: %s", what, time.perf_counter() - t, choice)
    record = {"choice": choice, "cpu": cpu_info(), "torch": torch.__version__, "model": backbone.name,
              "timings": timings, "measured": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data[key] = record
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as exc:                            # a read-only home: measure again next time
        log.warning("could not cache the %s kernel choice in %s: %s", what, path, exc)
    return choice
