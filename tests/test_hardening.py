"""A public Space gets every kind of input and many users at once: bad input, concurrency,
cancellation, broken artefacts, and what the server exposes. Tiny model, launched app."""
import json
import math
import shutil
import socket
import threading
import time

import pytest

import app
from viz import api_handlers
from viz import handlers
from viz import startup
from viz import studio as vstudio
from viz.session import Session
from ssd_core.engine.decode import DecodeConfig, Start, decode
from ssd_core.engine.generate import generate as core_generate
from ssd_core.policies.ar import Autoregressive

BAD_PROMPTS = {
    "empty": "",
    "whitespace": "  \n\t  ",
    "huge": "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 1150,   # ≈ 50,000 chars
    "control": "\x00\x07abc\x1b[31m red \x7f",
    "emoji": "🙂🚀 hello 👩‍🔬",
    "rtl": "مرحبا بالعالم، كيف حالك؟",
    "cjk": "你好，世界。今天天气怎么样？",
}
BAD_SETTINGS = {
    "max_new_huge": dict(max_new=10 ** 7),
    "max_new_negative": dict(max_new=-5),
    "max_new_nan": dict(max_new=float("nan")),
    "gamma_zero": dict(gamma=0),
    "gamma_nan": dict(gamma=float("nan")),
    "threshold_high": dict(threshold=1.5),
    "threshold_negative": dict(threshold=-0.1),
    "temperature_nan": dict(temperature=float("nan")),
    "top_p_inf": dict(top_p=float("inf")),
    "k_nan": dict(k=float("nan")),
}
GOOD = dict(domain=None, max_new=12, gamma=3, threshold=0.0, temperature=0.0, top_p=1.0, k=5)


@pytest.fixture(scope="module")
def studio(tiny, tiny_calibration):
    return startup.load_studio(backbone=tiny, calibration=tiny_calibration.folder, warm=False)


def run_handler(studio, prompt, **kw):
    s = {**GOOD, **kw}
    return list(handlers.generate(studio, None, prompt, "KNN-SSD", s["domain"], s["max_new"], s["gamma"],
                             s["threshold"], s["temperature"], s["top_p"], s["k"]))


def tokens_html(outputs):
    return "".join(str(o["tokens"]) for o in outputs if "tokens" in o)


# --- the corpus through the handler the UI uses -------------------------------------------------------
@pytest.mark.parametrize("case", BAD_PROMPTS)
def test_bad_prompts_through_the_handler(studio, case):
    out = run_handler(studio, BAD_PROMPTS[case])
    html = tokens_html(out)
    assert "Traceback" not in html
    if case in ("empty", "whitespace"):
        assert "Type a prompt" in html
    else:
        assert 'class="tok' in html                       # it generated


def test_huge_prompt_is_shortened_with_a_notice(studio):
    out = run_handler(studio, BAD_PROMPTS["huge"])
    assert any("shortened" in str(o.get("stats", "")) for o in out)


@pytest.mark.parametrize("case", BAD_SETTINGS)
def test_bad_settings_through_the_handler(studio, case):
    html = tokens_html(run_handler(studio, "hello", **BAD_SETTINGS[case]))
    assert "Setting not accepted" in html and "Traceback" not in html


@pytest.mark.parametrize("case", BAD_SETTINGS)
def test_bad_settings_through_the_api_function(studio, case):
    s = {**GOOD, **BAD_SETTINGS[case]}
    if case == "k_nan":
        pytest.skip("the plain API has no K")
    res = api_handlers.generate_text(studio, "hello", "KNN-SSD", s["max_new"], s["gamma"], s["threshold"],
                            s["temperature"], s["top_p"])
    assert "error" in res and "Setting not accepted" in res["error"]


def test_control_characters_are_dropped_and_unicode_kept():
    assert vstudio.clean_prompt("a\x00b\x1bc\nd\te") == "abc\nd\te"
    assert vstudio.clean_prompt(BAD_PROMPTS["cjk"]) == BAD_PROMPTS["cjk"]
    assert vstudio.clean_prompt(None) == ""


def test_request_size_limit(studio):
    res = api_handlers.generate_text(studio, "x" * (vstudio.MAX_PROMPT_CHARS + 1))
    assert "limit" in res["error"]


# --- a launched app, through gradio_client ------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(studio):
    demo = app.build(studio)
    port = _free_port()
    app.launch(demo, studio, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    url = f"http://127.0.0.1:{port}"
    yield url
    demo.close()


def _client(url):
    from gradio_client import Client
    return Client(url, verbose=False)


CLIENT_CASES = {**{k: (v, {}) for k, v in BAD_PROMPTS.items()},
                **{k: ("hello", v) for k, v in BAD_SETTINGS.items() if k != "k_nan"}}


@pytest.mark.parametrize("case", CLIENT_CASES)
def test_bad_input_through_gradio_client(served, case):
    prompt, settings = CLIENT_CASES[case]
    # JSON has no NaN / inf: a client can only send them as text, which the server must refuse too
    s = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
         for k, v in {**GOOD, **settings}.items()}
    res = _client(served).predict(prompt, "KNN-SSD", s["max_new"], s["gamma"], s["threshold"],
                                  s["temperature"], s["top_p"], api_name="/generate_text")
    if case in ("empty", "whitespace") or case in BAD_SETTINGS:
        assert "error" in res
    else:
        assert res.get("new_tokens", 0) >= 1, res
    # and the server keeps serving
    ok = _client(served).predict("still there?", "KNN-SSD", 4, 3, 0.0, 0.0, 1.0, api_name="/generate_text")
    assert ok["new_tokens"] >= 1


def test_eight_clients_at_once_are_queued_not_refused_and_each_gets_its_own_lossless_text(served, tiny):
    """Eight clients sent together are served (in the model's lane of max_rows; this server has no engine
    attached, so each decodes on its own thread): none is refused by the queue or the per-visitor cap, and
    none gets another's text."""
    prompts = [f"client {i}: tell me about {w}" for i, w in
               enumerate(["cats", "rain", "maths", "trains", "tea", "stars", "music", "code"])]
    cfg = DecodeConfig(max_new_tokens=16, gamma=3, max_prompt_tokens=vstudio.MAX_PROMPT_TOKENS)
    expected = {p: core_generate(tiny, p, Autoregressive(), cfg).text for p in prompts}
    got, errors = {}, []

    def one(p):
        try:
            got[p] = _client(served).predict(p, "KNN-SSD", 16, 3, 0.0, 0.0, 1.0, api_name="/generate_text")
        except Exception as exc:         # noqa: BLE001 - the test reports every failure
            errors.append(exc)
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors
    for p in prompts:
        assert got[p]["text"] == expected[p]


def test_no_file_system_paths_in_the_config(served):
    import urllib.request
    body = urllib.request.urlopen(served + "/config", timeout=30).read().decode()
    assert str(app.ROOT) not in body


# --- cancellation -----------------------------------------------------------------------------
def test_stop_ends_generation_within_one_step(studio):
    session = Session()
    before = threading.active_count()
    gen = handlers.generate(studio, session, "count to one hundred", "KNN-SSD", None, 200, 3, 0.0, 0.0, 1.0, 5)
    next(gen)
    next(gen)
    session.stop = True
    rest = list(gen)
    assert len(rest) <= 3                    # the step in flight, then the closing views
    assert session.run.stats.new_tokens < 200
    assert threading.active_count() <= before
    again = run_handler(studio, "and the next request works")
    assert 'class="tok' in tokens_html(again)


def test_should_stop_is_polled_every_step(tiny):
    calls = []

    def stop_after_two():            # polled once while the prompt is read, then before every step
        calls.append(1)
        return len(calls) > 3
    events = list(decode(tiny, "stop me", Autoregressive(), DecodeConfig(max_new_tokens=50),
                         should_stop=stop_after_two))
    assert isinstance(events[0], Start) and len(events) == 3 and len(calls) == 4


# --- artefacts ------------------------------------------------------------------------------------
def test_corrupt_calibration_falls_back_with_a_banner(tiny, tiny_calibration, tmp_path, monkeypatch):
    # the broken calibration lies inside the repo, as the committed one does (ROOT → tmp_path here)
    monkeypatch.setattr(vstudio, "ROOT", tmp_path)
    bad = tmp_path / "assets" / "calibration" / "tiny"
    shutil.copytree(tiny_calibration.folder, bad)
    (bad / "router.npz").write_bytes(b"garbage")
    st = startup.load_studio(backbone=tiny, calibration=bad, warm=False)
    assert st.calibration is None
    assert "checksum mismatch" in st.cal_error
    # the banner names the file relative to the repo and never shows the repo's absolute path
    assert "checksum mismatch for assets/calibration/tiny/router.npz" in st.cal_error, st.cal_error
    assert str(tmp_path) not in st.cal_error, st.cal_error
    res = api_handlers.generate_text(st, "hello there", "KNN-SSD", 8)
    assert res["strategy"] == "ar" and res["new_tokens"] >= 1


def test_missing_calibration_falls_back(tiny, tmp_path):
    st = startup.load_studio(backbone=tiny, calibration=tmp_path / "none", warm=False)
    assert st.calibration is None and "python -m ssd_core.calibrate" in st.cal_error


def test_public_message_hides_repo_paths():
    msg = vstudio.public_message(f"checksum mismatch for {vstudio.ROOT}/assets/calibration/x/router.npz")
    assert str(vstudio.ROOT) not in msg and "assets/calibration/x/router.npz" in msg
