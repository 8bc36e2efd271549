"""The figures a reader sees in README.md, docs/space.md and docs/performance.md's start-up section are
the committed results they come from: RSS (assets/bench/loadtest.json, soak.json), start-up
(assets/bench/startup.json, written by `python -m ssd_core.tools.startup_bench`) and draft cost c (the
committed calibrations' latency profiles). Each test reads the page and the file and fails when they
part, whichever of the two changed: re-measuring means updating the sentence too.

Pages are read with their whitespace collapsed, so a figure may wrap across lines. A test that cannot
find its sentence says so: a rephrased sentence needs its pattern here updated, not the check dropped.
"""
from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "assets" / "bench"
DEFAULT_CAL = ROOT / "assets" / "calibration" / "smollm2-135m-instruct" / "calibration.json"
LAYER_CAL = ROOT / "assets" / "calibration" / "smollm2-135m-instruct-knnssd" / "calibration.json"
NUM = r"(\d[\d,]*(?:\.\d+)?)"    # a figure: 3,358 or 0.5 (a sentence's full stop is not part of it)
CONTEXT = 256          # the context length the pages' c figures are read at (LatencyModel's default)


def page(rel: str) -> str:
    return " ".join((ROOT / rel).read_text(encoding="utf-8").split())


def section(rel: str, heading: str) -> str:
    """One `## heading` section of a page, whitespace collapsed."""
    text = (ROOT / rel).read_text(encoding="utf-8")
    found = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert found, f"{rel} has no '## {heading}' section"
    return " ".join(found.group(1).split())


def figures(pattern: str, text: str, where: str) -> list[tuple[float, ...]]:
    """Every match of `pattern` in `text` as floats (commas dropped); at least one must exist."""
    found = [m if isinstance(m, tuple) else (m,) for m in re.findall(pattern, text)]
    assert found, (f"{where}: no sentence matches {pattern!r}; if it was rephrased, update the pattern in "
                   f"{Path(__file__).name}, keeping the figure checked")
    return [tuple(float(x.replace(",", "")) for x in m) for m in found]


def load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


# --- memory: the served app's RSS ---------------------------------------------------------------------


def test_readme_rss_is_the_load_tests():
    run = load(BENCH / "loadtest.json")
    warm, end = run["rss_mb_warm"], run["rss_mb_end"]
    text = page("README.md")
    for (gb,) in figures(rf"plan for about \*\*{NUM} GB RSS\*\*", text, "README.md"):
        # the figure to plan for is the end of the load test, to the GB's first decimal
        assert abs(gb * 1000 - end) <= 100, f"README plans for {gb} GB; loadtest.json ends at {end:.0f} MB"
    for w, e in figures(rf"held {NUM} MB after warm-up and {NUM} MB at the end", text, "README.md"):
        assert (round(w), round(e)) == (round(warm), round(end)), \
            f"README: {w:.0f} → {e:.0f} MB; loadtest.json: {warm:.0f} → {end:.0f} MB"


def test_space_load_test_paragraph_is_the_committed_run():
    """docs/space.md's paragraph on the run `assets/bench/loadtest.json` holds: its counts, times and RSS."""
    run = load(BENCH / "loadtest.json")
    text = page("docs/space.md")
    para = re.search(r"\*\*Re-run on the final system.*?\(\+[\d.]+%\)", text)
    assert para and "assets/bench/loadtest.json" in para.group(0), "docs/space.md lost its load test paragraph"
    para = para.group(0)
    (warm, end), = figures(rf"RSS {NUM} → {NUM} MB", para, "docs/space.md")
    assert (round(warm), round(end)) == (round(run["rss_mb_warm"]), round(run["rss_mb_end"]))
    (ratio,), = figures(rf"p95 ratio {NUM}", para, "docs/space.md")
    assert ratio == round(run["p95_ratio"], 2)
    for phase in ("baseline", "mixed"):
        name = "alone" if phase == "baseline" else "mixed"
        (n, p50, p95), = figures(rf"{name} (\d+) requests, (?:p50 / p95 )?{NUM} / {NUM} s", para,
                                 "docs/space.md")
        got = run[phase]
        assert (n, p50, p95) == (got["requests"], round(got["e2e_p50_s"], 1), round(got["e2e_p95_s"], 1)), phase
    (grow,), = figures(r"\(\+([\d.]+)%\)", para, "docs/space.md")
    assert grow == round(100 * (run["rss_mb_end"] / run["rss_mb_warm"] - 1), 1)


def test_space_soak_figures_are_the_soak_file():
    soak = load(BENCH / "soak.json")
    text = page("docs/space.md")
    (before, after), = figures(rf"server RSS {NUM} → {NUM} MB \(`assets/bench/soak.json`\)", text,
                               "docs/space.md")
    assert (round(before), round(after)) == (round(soak["rss_mb_before"]), round(soak["rss_mb_after"]))
    (p50, p95), = figures(rf"p50 {NUM} s, p95 {NUM} s \(queued", text, "docs/space.md")
    assert (p50, p95) == (round(soak["p50_s"], 1), round(soak["p95_s"], 1))


# --- start-up -----------------------------------------------------------------------------------------


def startup() -> dict:
    return load(BENCH / "startup.json")


def test_startup_file_is_whole_and_its_medians_are_its_launches():
    run = startup()
    assert run["machine"]["cpu"]["model"], "startup.json names no CPU"
    assert run["started"] and run["machine"]["app_threads"] >= 1
    for kind, at_least in (("cold", 1), ("warm", 3)):
        launches = [r for r in run["runs"] if r["expected"] == kind]
        assert len(launches) >= at_least, f"{len(launches)} {kind} launches"
        assert all(r["kind"] == kind for r in launches), f"a {kind} launch printed another kind"
        for name in ("http_s", "reported_s", "imports_s", "model_s"):
            assert run["median"][kind][name] == round(statistics.median(r[name] for r in launches), 2), name
    assert run["median"]["cold"]["http_s"] > run["median"]["warm"]["http_s"]


def close_to(stated: float, measured: float) -> bool:
    """A page rounds a start-up time to the second: within 1 s, or 5% of a long one."""
    return abs(stated - measured) <= max(1.0, 0.05 * measured)


@pytest.mark.parametrize("rel", ["README.md", "docs/space.md"])
def test_startup_figures_are_the_bench_medians(rel):
    median = startup()["median"]
    for cold, warm in figures(rf"answers after ≈ {NUM} s cold and ≈ {NUM} s warm", page(rel), rel):
        assert close_to(cold, median["cold"]["http_s"]), f"{rel}: {cold} s cold; startup.json: {median['cold']}"
        assert close_to(warm, median["warm"]["http_s"]), f"{rel}: {warm} s warm; startup.json: {median['warm']}"


def test_performance_startup_section_is_the_bench_medians():
    """"**X s cold** (…imports A s, model B s…)" and the same for warm: the medians of startup.json."""
    median = startup()["median"]
    text = section("docs/performance.md", "Start-up")
    for kind in ("cold", "warm"):
        (total, imports, model), = figures(
            rf"\*\*{NUM} s {kind}\*\* \([^)]*?imports {NUM} s, model {NUM} s", text, "docs/performance.md")
        assert close_to(total, median[kind]["http_s"]), f"{kind}: {total} s; startup.json: {median[kind]}"
        assert abs(imports - median[kind]["imports_s"]) <= 0.05 + 1e-9, f"{kind} imports {imports} s"
        assert abs(model - median[kind]["model_s"]) <= 0.05 + 1e-9, f"{kind} model {model} s"


# --- draft cost c: the committed latency profiles -----------------------------------------------------


def latency(path: Path):
    from ssd_core.calibration.latency import LatencyModel
    from ssd_core.engine.skipset import SkipSet
    cal = load(path)
    model = LatencyModel.from_dict(cal["latency"])
    sets = {name: SkipSet(set(s["attn"]), set(s["mlp"]))
            for name, s in {**cal["domain_sets"], "static": cal["static"]}.items() if "attn" in s}
    return model, sets


def one_decimal(stated: float, value: float) -> bool:
    return abs(stated - value) <= 0.05 + 1e-9


def test_int8_draft_cost_is_the_default_profiles():
    model, sets = latency(DEFAULT_CAL)
    assert model.knows("int8"), "the default calibration's latency profile has no int8 draft costs"
    c = model.draft_cost(sets["static"], CONTEXT, "int8")
    text = page("README.md")
    stated = figures(rf"int8 draft brings c to ≈ {NUM}", text, "README.md")
    stated += figures(rf"int8 draft step still costs about half a full step \(c ≈ {NUM}", text, "README.md")
    stated += figures(rf"with the int8 draft c ≈ {NUM} of a step", page("docs/performance.md"),
                      "docs/performance.md")
    for (s,) in stated:
        assert one_decimal(s, c), f"a page says the int8 draft costs c ≈ {s}; the committed profile: {c:.3f}"
    if "about half" in text:
        assert 0.4 <= c <= 0.6, f"README says 'about half a full step'; the profile says {c:.3f}"


def test_layer_skipping_cost_and_verify_cost_are_the_profiles():
    model, sets = latency(LAYER_CAL)
    c = statistics.mean(model.draft_cost(s, CONTEXT) for s in sets.values())
    for page_rel in ("README.md", "docs/performance.md"):
        for (s,) in figures(rf"(?:layer skipping alone leaves c|the draft still costs) ≈ {NUM}", page(page_rel),
                            page_rel):
            assert one_decimal(s, c), f"{page_rel}: layer skipping c ≈ {s}; the layer sets' fp32 profile: {c:.3f}"
    default, _ = latency(DEFAULT_CAL)
    if "v > 1" in page("README.md"):
        assert all(default.verify_cost(k) > 1 for k in range(2, 6)), default.verify


# --- the start-up bench's own parsing (no app launched) ---------------------------------------------


def test_startup_bench_reads_the_apps_line():
    from ssd_core.tools import startup_bench as sb
    line = ("start-up (cold: first run converts the GGUF): 18.4 s (imports 6.0 s, model 10.0 s, calibration "
            "0.5 s, warm-up beside the UI build 2.0 s; the UMAP domain map loads in the background); calibration: x")
    assert sb.parse_startup("noise\n" + line + "\n") == {
        "kind": "cold", "reported_s": 18.4, "imports_s": 6.0, "model_s": 10.0, "calibration_s": 0.5,
        "warmup_ui_s": 2.0}
    assert sb.parse_startup("start-up (warm: model from cache): 9.9 s (imports 6.2 s, model 1.2 s")["kind"] == "warm"
    assert sb.parse_startup("no such line") == {}
    env = sb.app_env(Path("/tmp/h"), 1234)
    assert env["HOME"] == "/tmp/h" and env["GRADIO_SERVER_PORT"] == "1234"
    assert not {"SPACE_ID", "OMP_WAIT_POLICY"} & set(env)
    # a launcher, not a part of the app: it imports neither gradio nor torch
    probe = ("import sys, ssd_core.tools.startup_bench; "
             "print(sorted(m for m in ('gradio', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
