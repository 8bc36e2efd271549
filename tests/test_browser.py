"""The real app in a real browser: `python app.py` on the embedded model, driven by Debian's Chromium.

Measures what a visitor feels: start-up time and click → first coloured token. The latter is timed
inside the page, from the click event to the frame that paints the token, so that the test driver's
own round trips (Python → playwright's driver → the browser, which on 2 busy cores added 0.1–0.5 s)
do not count; the driver's view is printed next to it. The limits are the product's (≤ 30 s, ≤ 1 s)
on this machine when it is not overloaded by other work; with a load average above the core count
they are loosened, and the test prints (and its assertion message says) the limit used and the load
average and core count that loosened it. The measured numbers are printed either way.
The app runs as a visitor's machine would: in an empty HOME, without the test session's
OMP_WAIT_POLICY (conftest sets PASSIVE for the tests' own threads; it doubles an int8 draft step).
Screenshots go to $KNN_SSD_SCREENSHOT_DIR (default: out/screenshots, git-ignored).
Without Chromium or playwright the tests skip locally, but FAIL when $CI is set: a CI run that
silently skipped the browser would report a green build that checked nothing.
"""
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.real, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]
PROMPT = "Translate German to English: Der Zug nach Berlin fährt um acht Uhr ab."
OTHER = "Write a SQL query that lists the names of customers who live in Paris."


# The token palette (UI.md, viz/theme.py): text in the kind's ink (its AA-contrast shade), on the
# kind's tint; rejected drafts struck through and verifier tokens underlined in the key colour.
TOKEN_STYLE = {
    "acc": {"color": "rgb(31, 122, 69)", "background": "rgb(227, 245, 234)", "line": "none"},
    "rej": {"color": "rgb(169, 50, 38)", "background": "rgb(251, 227, 224)", "line": "line-through",
            "line_color": "rgb(192, 57, 43)"},        # ink #a93226 on #fbe3e0, struck in #c0392b
    "ver": {"color": "rgb(37, 89, 154)", "background": "rgb(227, 236, 248)", "line": "underline",
            "line_color": "rgb(47, 109, 181)"},       # ink #25599a on #e3ecf8, underlined in #2f6db5
}
COMPUTED_STYLE_JS = """els => els.map(e => { const s = getComputedStyle(e);
    return {text: e.innerText, color: s.color, background: s.backgroundColor,
            line: s.textDecorationLine, line_color: s.textDecorationColor}; })"""


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _missing(what: str) -> None:
    """Skip locally; fail in CI, where a skipped browser test would hide that nothing was checked."""
    if _in_ci():
        pytest.fail(f"{what} (CI={os.environ['CI']!r}: the browser tests must run, not skip)", pytrace=False)
    pytest.skip(what)


def _load() -> tuple[float, int]:
    """(1-minute load average, cores) now."""
    return os.getloadavg()[0], os.cpu_count() or 1


def _limit(what: str, product_s: float, loosened_s: float, load: tuple[float, int]) -> tuple[float, str]:
    """The limit for `what`: the product's, or `loosened_s` when the load average was above the core
    count (other work on the machine); and words naming the limit used and the load behind it, printed
    at once and meant for the assertion message."""
    avg, cores = load
    loosened = avg > cores
    words = (f"{what}: limit LOOSENED to {loosened_s} s from the product's {product_s} s, because the load "
             f"average was {avg:.2f} on {cores} cores" if loosened else
             f"{what}: the product's limit {product_s} s (load average {avg:.2f} on {cores} cores)")
    print("\n" + words)
    return (loosened_s if loosened else product_s), words


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(env: dict, port: int):
    """Start `python app.py`; return (process, lines printed, seconds until "Running on")."""
    cmd = [sys.executable, "app.py"]
    if os.environ.get("KNN_SSD_TEST_CALIBRATION"):
        cmd += ["--calibration", os.environ["KNN_SSD_TEST_CALIBRATION"]]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "Running on" in line:
            return proc, lines, time.perf_counter() - t0
        if time.perf_counter() - t0 > 240:
            _stop(proc)
            pytest.fail("the app did not start within 240 s:\n" + "".join(lines[-30:]))
    pytest.fail(f"the app exited during start-up (exit code {proc.wait()}):\n" + "".join(lines[-30:]))


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def _reported(lines) -> float | None:
    found = re.search(r"start-up \((cold|warm)[^)]*\): ([\d.]+) s", "".join(lines))
    return float(found.group(2)) if found else None


def app_env(home: Path, port: int) -> dict:
    """The environment `python app.py` runs in: the tests' own, with the app finding its caches under the
    empty `home` (as on a new machine; not the session's KNN_SSD_CACHE) and without the OMP_WAIT_POLICY
    conftest sets for the tests' threads."""
    env = {k: v for k, v in os.environ.items() if k not in ("KNN_SSD_CACHE", "OMP_WAIT_POLICY")}
    env.update({"HOME": str(home), "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
                "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "PYTHONUNBUFFERED": "1"})
    return env


@pytest.fixture(scope="module")
def fresh_home(tmp_path_factory):
    """An empty HOME: the app starts as on a new machine or a rebuilt Space (no model cache)."""
    return tmp_path_factory.mktemp("empty-home")


@pytest.fixture(scope="module")
def server(fresh_home):
    if not os.path.exists(CHROMIUM):
        _missing(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _missing("playwright (python) is not installed: pip install -r requirements-dev.txt")
    port = _free_port()
    env = app_env(fresh_home, port)
    # first a cold start (converts the GGUF into the empty HOME), stopped at once so that its background
    # UMAP import does not compete with the second, warm start, which then serves the tests
    proc, cold_lines, cold = _launch(env, port)
    cold_load = _load()                           # the load the start-up ran under (1-minute average)
    _stop(proc)
    port = _free_port()
    env["GRADIO_SERVER_PORT"] = str(port)
    proc, lines, wall = _launch(env, port)
    warm_load = _load()
    try:
        yield {"url": f"http://127.0.0.1:{port}", "cold_s": cold, "cold_log": "".join(cold_lines),
               "cold_load": cold_load, "wall_s": wall, "log": "".join(lines), "warm_load": warm_load,
               "startup_s": _reported(lines) or wall}
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def browser(server):
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def _open(browser, url):
    page = browser.new_context(viewport={"width": 1280, "height": 720}).new_page()
    page.goto(url)
    page.wait_for_selector("#generate-btn", timeout=60_000)
    page.wait_for_selector("#domain-map .js-plotly-plot", timeout=60_000)
    return page


def _shots() -> Path:
    d = Path(os.environ.get("KNN_SSD_SCREENSHOT_DIR", ROOT / "out" / "screenshots"))
    d.mkdir(parents=True, exist_ok=True)
    return d


# In the page: the Generate click's event time, when a token of this run enters the panel, and the
# frame after the one that painted it (two animation frames later: an upper bound on the paint).
WATCH_FIRST_PAINT_JS = """() => {
    const t = window.__firstToken = {click: null, token: null, paint: null};
    const onClick = e => {
        if (!e.target.closest('#generate-btn')) return;
        t.click = e.timeStamp;
        document.removeEventListener('click', onClick, {capture: true});
    };
    document.addEventListener('click', onClick, {capture: true});
    const panel = document.querySelector('#tokens');
    const watch = new MutationObserver(() => {
        if (t.token !== null || !panel.querySelector('.tok:not(.earlier-run)')) return;
        t.token = performance.now();
        watch.disconnect();
        requestAnimationFrame(() => requestAnimationFrame(() => { t.paint = performance.now(); }));
    });
    watch.observe(panel, {subtree: true, childList: true, characterData: true});
}"""


def _first_token_after_click(page, prompt: str) -> tuple[float, float]:
    """(click → first token painted, timed in the page; click → token as the test driver saw it), seconds."""
    page.fill("#prompt textarea", prompt)
    page.wait_for_timeout(300)                     # let the textbox's value reach the app
    # mark what an earlier run left, so that neither its tokens nor its "done" count for this run
    # (the app replaces the panel's content with its first update)
    page.evaluate("document.querySelectorAll('#tokens .tok, #tokens .stream-status')"
                  ".forEach(e => e.classList.add('earlier-run'))")
    page.evaluate(WATCH_FIRST_PAINT_JS)
    t0 = time.perf_counter()
    page.click("#generate-btn")
    page.wait_for_selector("#tokens .tok:not(.earlier-run)", timeout=30_000)
    driver = time.perf_counter() - t0
    page.wait_for_function("window.__firstToken.paint !== null", timeout=30_000)
    t = page.evaluate("window.__firstToken")
    assert t["click"] is not None and t["click"] <= t["token"] <= t["paint"], t
    page.wait_for_function("!document.querySelector('#tokens .earlier-run') && "
                           "document.querySelector('#tokens').innerText.includes('done')", timeout=180_000)
    return (t["paint"] - t["click"]) / 1000, driver


def _wait_for_prompt_on_map(page, prompt: str, limit_s: float = 240) -> None:
    """The UMAP domain map loads in the background after start-up ("domain map loading …"); a run
    draws the prompt's star once it is ready. Only "loading" excuses a map without the star."""
    deadline = time.perf_counter() + limit_s
    while "your prompt" not in (text := page.inner_text("#domain-map")):
        assert "loading" in text, f"no prompt on the domain map, and it is not loading: {text!r}"
        assert time.perf_counter() < deadline, f"the domain map was still loading after {limit_s} s"
        page.wait_for_timeout(5_000)
        _first_token_after_click(page, prompt)


def test_cold_start_up_is_quick_enough(server):
    """From an empty HOME: the first run converts the GGUF (≤ 30 s on 2 cores when not overloaded)."""
    log = server["cold_log"]
    assert "start-up (cold" in log, log[-2000:]
    limit, why = _limit("cold start-up", 30, 90, server["cold_load"])
    print(f"cold start-up: {server['cold_s']:.1f} s from `python app.py` to 'Running on' (the app reports "
          f"{_reported(server['cold_log'])} s)")
    assert server["cold_s"] <= limit, f"cold start-up {server['cold_s']:.1f} s; {why}\n" + log[-2000:]


def test_warm_start_up_is_quick_enough(server):
    """The second launch in the same HOME reads the dequantised model from the cache (≤ 15 s)."""
    log = server["log"]
    assert "start-up (warm" in log, log[-2000:]
    limit, why = _limit("warm start-up", 15, 45, server["warm_load"])
    print(f"warm start-up: {server['wall_s']:.1f} s (the app reports {server['startup_s']} s)")
    assert server["wall_s"] <= limit, f"warm start-up {server['wall_s']:.1f} s; {why}\n" + log[-2000:]


def test_generate_streams_coloured_tokens_and_both_plots(server, browser):
    page = _open(browser, server["url"])
    firsts = [_first_token_after_click(page, PROMPT)]        # may share the CPU with the map's background load
    # the app runs on the committed calibration: no fallback banner, KNN routing, real drafts
    assert "calibration: loaded from" in server["log"], server["log"][-2000:]
    body = page.inner_text("body")
    assert "No usable calibration" not in body and "No calibration" not in body
    assert "routed to translation" in page.inner_text("#route"), page.inner_text("#route")
    _wait_for_prompt_on_map(page, PROMPT)
    firsts.append(_first_token_after_click(page, PROMPT))     # start-up work done: no first-call costs at all
    limit, why = _limit("click → first coloured token", 1.0, 2.0, _load())
    print(f"click → first coloured token painted: {', '.join(f'{t:.2f} s' for t, _ in firsts)} (timed in the "
          f"page; the test driver saw it after {', '.join(f'{d:.2f} s' for _, d in firsts)})")
    assert min(t for t, _ in firsts) <= limit, f"first token {min(t for t, _ in firsts):.2f} s; {why}"
    # greedy KNN-SSD with γ = 4 over 96 tokens: drafts are accepted and rejected, the verifier adds its own
    kinds = {k: page.locator(f"#tokens .tok.{k}").count() for k in ("acc", "rej", "ver")}
    assert kinds["acc"] >= 1 and kinds["rej"] >= 1 and kinds["ver"] >= 1 and sum(kinds.values()) >= 8, kinds
    for cls, want in TOKEN_STYLE.items():
        styles = page.eval_on_selector_all(f"#tokens .tok.{cls}", COMPUTED_STYLE_JS)
        assert styles, cls
        for got in styles:
            assert got["color"] == want["color"] and got["background"] == want["background"], (cls, got)
            assert got["line"] == want["line"], (cls, got)
            if "line_color" in want:
                assert got["line_color"] == want["line_color"], (cls, got)
    for plot in ("#domain-map", "#layer-map"):
        assert page.locator(f"{plot} .js-plotly-plot .main-svg").count() >= 1
    page.locator("#tokens .tok").nth(3).hover()
    page.wait_for_selector(".ssd-tip", state="visible", timeout=5_000)
    assert "step" in page.inner_text(".ssd-tip")
    page.screenshot(path=str(_shots() / "generate.png"))


def test_a_second_session_does_not_see_the_first(server, browser):
    first = _open(browser, server["url"])
    _first_token_after_click(first, PROMPT)
    text_first = first.inner_text("#tokens")
    second = _open(browser, server["url"])                          # a new browser context = new visitor
    assert second.locator("#tokens .tok").count() == 0
    assert "The answer streams here" in second.inner_text("#tokens")
    second.get_by_role("tab", name="Why (not) faster?").click()
    assert "no run yet" in second.inner_text("#cost") or "needs a calibration" in second.inner_text("#cost")
    second.get_by_role("tab", name="Generate").click()
    _first_token_after_click(second, OTHER)
    assert first.inner_text("#tokens") == text_first               # the first visitor's view is untouched
    assert second.inner_text("#tokens") != text_first


def test_race_and_step_through_in_the_browser(server, browser):
    page = _open(browser, server["url"])
    page.fill("#prompt textarea", PROMPT)
    page.wait_for_timeout(300)
    page.click("#race-btn")
    page.wait_for_function("document.querySelector('#race').innerText.includes('×')", timeout=240_000)
    race = page.inner_text("#race")
    # greedy (the default, temperature 0): speculation must reproduce autoregressive text exactly
    assert "tok/s" in race and "identical" in race, race
    assert "differ" not in race and "sampling" not in race, race
    page.screenshot(path=str(_shots() / "race.png"))
    page.get_by_role("tab", name="Step through").click()
    page.click("#walk-start")
    page.wait_for_selector("#walk .walk-table", timeout=60_000)
    page.click("#walk-verify")
    page.wait_for_function("document.querySelector('#walk').innerText.includes('verifier')")
    page.click("#walk-accept")
    page.wait_for_function("document.querySelector('#walk').innerText.includes('verdict')")
    page.screenshot(path=str(_shots() / "step_through.png"), full_page=True)


def test_race_vs_static_in_the_browser(server, browser):
    """Race vs static: the routed draft against the static draft, with both τ and routing's verdict."""
    page = _open(browser, server["url"])
    page.fill("#prompt textarea", OTHER)
    page.wait_for_timeout(300)
    page.click("#race-static-btn")
    page.wait_for_function("document.querySelector('#race').innerText.includes('static draft') && "
                           "document.querySelector('#race').innerText.includes('×')", timeout=240_000)
    race = page.inner_text("#race")
    assert "identical" in race and "τ" in race, race
    assert "Same draft as static" in race or "Routing's own gain" in race, race
    page.screenshot(path=str(_shots() / "race_static.png"), full_page=True)


def test_a_visitor_picks_a_calibration_for_themselves(server, browser):
    """The calibration chooser: the layer-set calibration for one page, the served one for another."""
    page = _open(browser, server["url"])
    other = _open(browser, server["url"])
    page.click("#calibration input")
    page.get_by_role("option", name="knnssd · KNN-SSD layer sets").click()
    page.wait_for_function("document.querySelector('#cal-info').innerText.includes('knnssd')", timeout=30_000)
    info = page.inner_text("#cal-info")
    assert "draft with a set of their own" in info and "MB" in info, info
    assert "served" in other.inner_text("#cal-info")            # the other visitor's page is unchanged
    page.fill("#prompt textarea", "Write a SQL query that lists the ten customers with the highest total spend.")
    page.wait_for_timeout(300)
    page.click("#race-static-btn")
    page.wait_for_function("document.querySelector('#race').innerText.includes('static draft') && "
                           "document.querySelector('#race').innerText.includes('×')", timeout=240_000)
    assert "identical" in page.inner_text("#race")
    page.screenshot(path=str(_shots() / "calibration_choice.png"))
    other.close()


TOKENS_JS = """els => els.map(e => ({cls: e.className, text: e.innerText, tip: e.dataset.tip,
    color: getComputedStyle(e).color, background: getComputedStyle(e).backgroundColor}))"""


def test_a_downloaded_trace_replays_with_the_same_coloured_tokens(server, browser, tmp_path):
    """Generate, download the run's trace, load it back and replay it: the same coloured tokens, and the
    file round-trips exactly (the downloaded replay equals the downloaded run)."""
    from ssd_core.engine.trace import Trace
    page = _open(browser, server["url"])
    _first_token_after_click(page, PROMPT)
    live = page.eval_on_selector_all("#tokens .tok", TOKENS_JS)
    assert live and any("rej" in t["cls"] for t in live) and any("acc" in t["cls"] for t in live)
    page.wait_for_selector("#trace-download a.trace-link", timeout=30_000)   # the run's trace is in the link
    with page.expect_download(timeout=30_000) as dl:
        page.click("#trace-download a.trace-link")
    path = tmp_path / "run.json"
    dl.value.save_as(path)
    trace = Trace.load(path)
    assert trace.model and trace.prompt == PROMPT and trace.strategy == "knn"

    page.reload()                                                   # a new page: the run is gone
    page.wait_for_selector("#generate-btn", timeout=60_000)
    assert page.locator("#tokens .tok").count() == 0
    page.click("#replay-box")
    page.set_input_files("#trace-upload input[type=file]", str(path))
    page.wait_for_timeout(1_000)
    page.click("#replay-btn")
    page.wait_for_function("document.querySelector('#tokens').innerText.includes('done')", timeout=120_000)
    assert "Replay of a KNN-SSD run" in page.inner_text("#stats")
    assert page.input_value("#prompt textarea") == PROMPT
    assert page.eval_on_selector_all("#tokens .tok", TOKENS_JS) == live
    page.screenshot(path=str(_shots() / "replay.png"))
    page.wait_for_selector("#trace-download a.trace-link", timeout=30_000)
    with page.expect_download(timeout=30_000) as dl2:
        page.click("#trace-download a.trace-link")
    again = tmp_path / "again.json"
    dl2.value.save_as(again)
    assert again.read_text(encoding="utf-8") == path.read_text(encoding="utf-8")
    # and the Step-through walks the replayed run
    page.get_by_role("tab", name="Step through").click()
    page.wait_for_selector("#walk .walk-table", timeout=10_000)


def test_dark_theme_zoomed_map_and_its_k_nearest(server, browser):
    """?__theme=dark: Gradio's dark class is on, tokens use the dark palette (AA on their tints); the map
    zooms to the prompt, lists its K nearest under it, and the toggle shows the whole map."""
    from viz import theme
    page = browser.new_context(viewport={"width": 1280, "height": 720}).new_page()
    page.goto(server["url"] + "/?__theme=dark")
    page.wait_for_selector("#generate-btn", timeout=60_000)
    assert "dark" in page.evaluate("document.body.className")
    _first_token_after_click(page, PROMPT)
    _wait_for_prompt_on_map(page, PROMPT)

    def rgb(hex_color):
        return "rgb({}, {}, {})".format(*(int(hex_color[i:i + 2], 16) for i in (1, 3, 5)))
    for cls, kind in (("acc", "accepted"), ("rej", "rejected"), ("ver", "verifier")):
        want = theme.DARK_KINDS[kind]
        styles = page.eval_on_selector_all(f"#tokens .tok.{cls}", COMPUTED_STYLE_JS)
        assert styles, cls
        for got in styles:
            assert got["color"] == rgb(want.ink) and got["background"] == rgb(want.tint), (cls, got)
    assert page.evaluate("getComputedStyle(document.querySelector('.metric')).backgroundColor") == "rgba(0, 0, 0, 0)"
    k = page.locator("#route .route-why li").count()
    assert k == 5 and page.locator("#route .route-why li").first.is_visible()
    x_range = "Array.from(document.querySelector('#domain-map .js-plotly-plot')._fullLayout.xaxis.range)"
    zoomed = page.evaluate(x_range)
    page.get_by_text("whole map").click()
    page.wait_for_function(f"{x_range}[1] - {x_range}[0] > {zoomed[1] - zoomed[0]}", timeout=15_000)
    labels = page.eval_on_selector_all("#domain-map .annotation-text", "els => els.map(e => e.textContent)")
    assert {"math", "translation", "sql"} <= set(labels), labels
    page.screenshot(path=str(_shots() / "dark_theme.png"))
