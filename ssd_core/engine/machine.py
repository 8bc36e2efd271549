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
import torch.nn.functional as F

log = logging.getLogger(__name__)

# instruction sets that change which kernel wins (recorded with every choice and every latency profile)
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
                "amx_bf16", "asimd", "sve")
KERNELS = ("plain", "onednn", "split")   # Backbone.set_kernel
CHOICE_FILE = "kernels.json"


def cache_dir() -> Path:
    """Where the core caches what it measures or converts (never under assets/): $KNN_SSD_CACHE or
    ~/.cache/knn-ssd-studio."""
    return Path(os.environ.get("KNN_SSD_CACHE", Path.home() / ".cache" / "knn-ssd-studio"))


def cpu_info() -> dict:
    """{"model": the CPU's name, "flags": the KERNEL_FLAGS it has, "threads": torch's intra-op threads}."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Processor") and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
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


# --- the int8 draft's kernel per matrix -----------------------------------------------------------------
DRAFT_KERNELS = ("int8", "fp32")
# a mixed draft must beat int8 everywhere by 5% to be chosen: within that, a noisy VM (±6% between
# identical runs) would flip the cached choice by chance (one background measurement: 50.2 vs 50.7 ms)
DRAFT_MARGIN = 0.95


def draft_matrices(backbone) -> dict:
    """One decoder layer's matrices and the lm_head: what an int8 draft step multiplies by."""
    L = backbone.layers[0]
    return {"qkv": L.wqkv, "o": L.wo, "gate_up": L.wgu, "down": L.wdown, "head": backbone.lm_head}


def measure_draft_kernels(backbone, calls: int = 20, rounds: int = 5) -> dict:
    """µs of one token through each draft matrix (DRAFT_MATRICES) under the int8 dynamic-quantisation
    kernel and under fp32 `F.linear` on the verifier's own weights: {matrix: {kernel: µs}}, the best of
    `rounds` interleaved rounds (noise only ever adds time)."""
    from .draft import DRAFT_MATRICES, _int8_linear, _int8_pack
    best = {m: {k: float("inf") for k in DRAFT_KERNELS} for m in DRAFT_MATRICES}
    runs = {}
    for m, w in draft_matrices(backbone).items():
        x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
        packed = _int8_pack(w)
        runs[m] = {"int8": lambda x=x, p=packed: _int8_linear(x, p), "fp32": lambda x=x, w=w: F.linear(x, w)}
    with torch.inference_mode():
        for i in range(rounds + 1):                   # the first round warms up and is dropped
            for m, by in runs.items():
                for k, fn in by.items():
                    t = time.perf_counter()
                    n = calls if m != "head" else max(1, calls // 5)   # the lm_head takes ~1-5 ms a call
                    for _ in range(n):
                        fn()
                    if i:
                        best[m][k] = min(best[m][k], (time.perf_counter() - t) / n * 1e6)
    return {m: {k: round(us, 1) for k, us in by.items()} for m, by in best.items()}


def measure_draft_passes(backbone, candidates: list[dict], context: int = 64, repeats: int = 11) -> list[float]:
    """ms of one int8 draft pass (one token at `context`, no sublayer skipped) under each candidate
    {matrix: kernel}, interleaved, median of `repeats` (after one warm-up round)."""
    from .draft import DraftWeights
    drafts = [DraftWeights(backbone, "int8", kernels=c) for c in candidates]
    cache = backbone.new_cache(context + 2)
    cache.k.fill_(0.0), cache.v.fill_(0.0)
    times = [[] for _ in drafts]
    for i in range(repeats + 1):
        for j, d in enumerate(drafts):
            cache.length = context
            t = time.perf_counter()
            backbone.forward([1], cache, draft=d)
            if i:
                times[j].append(time.perf_counter() - t)
    return [round(1000 * statistics.median(t), 3) for t in times]


def fastest_draft_kernels(backbone, refresh: bool = False, measure_now: bool = True) -> dict[str, str] | None:
    """{matrix: "int8" or "fp32"}: which kernel an int8 draft runs each of its matrices on, on this machine
    — the int8 kernel, or fp32 on the verifier's own weights where that is faster. Isolated timings
    mislead (on one Xeon fp32 won q/k/v and o alone by 15–20%, yet the draft pass ran 20% slower with
    them mixed in), so the matrices that win alone only propose a candidate; whole draft passes under it
    and under int8 everywhere decide. Cached beside the verifier's choice, or measured now (≈ 2-4 s on
    2 cores); measure_now=False: None when nothing is cached."""
    from .draft import DRAFT_MATRICES

    def measure():
        alone = measure_draft_kernels(backbone)
        every = {m: "int8" for m in DRAFT_MATRICES}
        mixed = {m: min(DRAFT_KERNELS, key=by.get) for m, by in alone.items()}
        if mixed == every:
            return every, {"matrices_us": alone}
        passes = measure_draft_passes(backbone, [every, mixed])
        release_freed_memory()                        # the two drafts timed are gone
        return (mixed if passes[1] < DRAFT_MARGIN * passes[0] else every), {
            "matrices_us": alone, "draft_pass_ms": {"int8 everywhere": passes[0], "fastest alone": passes[1]}}
    valid = lambda c: isinstance(c, dict) and set(c) == set(DRAFT_MATRICES) and set(c.values()) <= set(DRAFT_KERNELS)  # noqa: E731
    choice = _cached_choice("draft:" + _choice_key(backbone), backbone, measure, valid, "int8 draft", refresh,
                            measure_now)
    return None if choice is None else dict(choice)


def _cached_choice(key: str, backbone, measure, valid, what: str, refresh: bool, measure_now: bool = True):
    """The choice cached under `key` in kernels.json, or `measure()` → (choice, timings) now, cached
    (measure_now=False: None instead of measuring)."""
    path = cache_dir() / CHOICE_FILE
    entry = _read(path).get(key)
    if not refresh and isinstance(entry, dict) and valid(entry.get("choice")):
        return entry["choice"]
    if not measure_now:
        return None
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
