"""The real app in a real browser: `python app.py` on the embedded model, driven by Debian's Chromium.

Measures what a visitor feels: start-up time and click → first coloured token. The limits are the
product's (≤ 30 s, ≤ 1 s) on this machine when it is not overloaded by other work; with a load
average above the core count they are relaxed (and the measured numbers are printed either way).
Screenshots go to $KNN_SSD_SCREENSHOT_DIR (default: out/screenshots, git-ignored).
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


def _busy() -> bool:
    return os.getloadavg()[0] > (os.cpu_count() or 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api", reason="playwright (python) is not installed")
    port = _free_port()
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "app.py"]
    if os.environ.get("KNN_SSD_TEST_CALIBRATION"):
        cmd += ["--calibration", os.environ["KNN_SSD_TEST_CALIBRATION"]]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "Running on" in line:
                break
            if time.perf_counter() - t0 > 240:
                pytest.fail("the app did not start within 240 s:\n" + "".join(lines[-30:]))
        else:
            pytest.fail(f"the app exited during start-up (exit code {proc.wait()}):\n" + "".join(lines[-30:]))
        wall = time.perf_counter() - t0
        reported = re.search(r"start-up: ([\d.]+) s", "".join(lines))
        yield {"url": f"http://127.0.0.1:{port}", "wall_s": wall, "log": "".join(lines),
               "startup_s": float(reported.group(1)) if reported else wall}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


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


def _first_token_after_click(page, prompt: str) -> float:
    page.fill("#prompt textarea", prompt)
    page.wait_for_timeout(300)                     # let the textbox's value reach the app
    t0 = time.perf_counter()
    page.click("#generate-btn")
    page.wait_for_selector("#tokens .tok", timeout=30_000)
    first = time.perf_counter() - t0
    page.wait_for_function("document.querySelector('#tokens').innerText.includes('done')", timeout=180_000)
    return first


def test_startup_is_quick_enough(server):
    limit = 90 if _busy() else 30
    print(f"\nstart-up: {server['wall_s']:.1f} s from `python app.py` to 'Running on' (the app reports "
          f"{server['startup_s']:.1f} s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"limit {limit} s)")
    assert server["wall_s"] <= limit, server["log"][-2000:]


def test_generate_streams_coloured_tokens_and_both_plots(server, browser):
    page = _open(browser, server["url"])
    firsts = [_first_token_after_click(page, PROMPT)]
    firsts.append(_first_token_after_click(page, PROMPT))     # the second click: no first-call costs at all
    limit = 2.0 if _busy() else 1.0
    print(f"\nclick → first coloured token: {', '.join(f'{t:.2f} s' for t in firsts)} "
          f"(load average {os.getloadavg()[0]:.1f}; limit {limit} s)")
    assert min(firsts) <= limit
    kinds = {k: page.locator(f"#tokens .tok.{k}").count() for k in ("acc", "rej", "ver")}
    assert kinds["ver"] >= 1 and sum(kinds.values()) >= 8, kinds
    calibrated = "No calibration" not in page.inner_text("body")
    if calibrated:
        assert kinds["acc"] + kinds["rej"] >= 1, kinds              # something was drafted
        assert "routed to" in page.inner_text("#route") or "unknown" in page.inner_text("#route")
        page.wait_for_function("document.querySelector('#domain-map').innerText.includes('your prompt')")
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
    assert "tok/s" in race and ("identical" in race or "differ" in race or "sampling" in race)
    page.screenshot(path=str(_shots() / "race.png"))
    page.get_by_role("tab", name="Step through").click()
    page.click("#walk-start")
    page.wait_for_selector("#walk .walk-table", timeout=60_000)
    page.click("#walk-verify")
    page.wait_for_function("document.querySelector('#walk').innerText.includes('verifier')")
    page.click("#walk-accept")
    page.wait_for_function("document.querySelector('#walk').innerText.includes('verdict')")
    page.screenshot(path=str(_shots() / "step_through.png"), full_page=True)
