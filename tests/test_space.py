"""A public Space that one visitor cannot hold or change: admin events absent from a public server, every
event posted over plain HTTP, the caps, lanes, bounded state and files, and the small holes (seeds, hand-
edited traces, a one-entry latency table, a decode that raises, a race that parts at a near-tie)."""
import asyncio
import base64
import dataclasses
import json
import re
import socket
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

import app
import ssd_core.calibration.build
from ssd_core.calibration.latency import LatencyModel
from ssd_core.engine.decode import Step
from ssd_core.engine.ties import NEAR_TIE, logit_gap
from ssd_core.engine.trace import Trace
from viz import adapter
from viz import api_handlers
from viz import handlers
from viz import race_handlers
from viz import limits as vlimits
from viz import startup
from viz import stats as vstats
from viz import trace_handlers as th
from viz import walk_handlers as wh
from viz.limits import CAPS, Limits
from viz.studio import Studio

PROMPT = "Translate German to English: Guten Morgen, wie geht es dir?"
SETTINGS = (PROMPT, "KNN-SSD", "translation", 24, 3, 0.0, 0.0, 1.0, 5)
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def studio(tiny, tiny_calibration):
    return startup.load_studio(backbone=tiny, calibration=tiny_calibration.folder, warm=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(folder: Path) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def _post_every_event(url: str, config: dict, timeout_s: float = 120.0) -> dict:
    """Post every dependency in /config to the queue (or the direct route for queue=False events) with its
    inputs' default values, as any HTTP client could, whatever the event's visibility; → {fn_index: status}."""
    values = {c["id"]: c.get("props", {}).get("value") for c in config["components"]}
    results = {}
    with httpx.Client(base_url=url, timeout=30) as client:
        for i, dep in enumerate(config["dependencies"]):
            fn = dep.get("id", i)
            body = {"data": [values.get(c) for c in dep["inputs"]], "fn_index": fn, "session_hash": f"probe{fn}",
                    "event_data": None, "trigger_id": None}
            r = client.post("/gradio_api/queue/join", json=body)
            if r.status_code != 200:
                results[fn] = r.status_code
                continue
            deadline = time.monotonic() + timeout_s
            with client.stream("GET", "/gradio_api/queue/data", params={"session_hash": f"probe{fn}"}) as stream:
                for line in stream.iter_lines():
                    if time.monotonic() > deadline:
                        break
                    if line.startswith("data:") and '"process_completed"' in line:
                        results[fn] = "completed"
                        break
    return results


@pytest.mark.parametrize("calibrated", [True, False], ids=["calibrated", "no-calibration"])
def test_no_event_of_a_public_server_calibrates_or_writes_to_assets(tiny, tiny_calibration, tmp_path, monkeypatch,
                                                                     calibrated):
    monkeypatch.setenv("SPACE_ID", "someone/knn-ssd-studio")
    calls = []
    monkeypatch.setattr(ssd_core.calibration.build, "calibrate", lambda *a, **kw: calls.append(kw) or tiny_calibration)
    installed = []
    monkeypatch.setattr(Studio, "install", lambda self, *a, **kw: installed.append(a))
    folder = tiny_calibration.folder if calibrated else tmp_path / "none"
    st = startup.load_studio(backbone=tiny, calibration=folder, warm=False, limits=Limits.resolve())
    assert st.limits.public
    before = _tree(ROOT / "assets")
    demo = app.build(st)
    assert not [f for f in demo.fns.values() if getattr(f.fn, "func", None) is app.run_calibration]
    port = _free_port()
    app.launch(demo, st, server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        url = f"http://127.0.0.1:{port}"
        config = httpx.get(url + "/config").json()
        results = _post_every_event(url, config)
    finally:
        demo.close()
    assert len(results) == len(config["dependencies"]) and any(v == "completed" for v in results.values())
    assert calls == [] and installed[1:] == [] and _tree(ROOT / "assets") == before


def test_a_private_server_without_calibration_is_the_only_one_with_the_calibration_event(tiny, tmp_path,
                                                                                         monkeypatch):
    bare = startup.load_studio(backbone=tiny, calibration=tmp_path / "none", warm=False)
    monkeypatch.delenv("SPACE_ID", raising=False)
    for name, allowed in (("127.0.0.1", True), ("localhost", True), ("0.0.0.0", False), ("10.1.2.3", False)):
        monkeypatch.setenv("GRADIO_SERVER_NAME", name)
        assert app.calibration_event_allowed(bare) is allowed, name
    monkeypatch.setenv("GRADIO_SERVER_NAME", "127.0.0.1")
    monkeypatch.setenv("SPACE_ID", "a/b")
    assert not app.calibration_event_allowed(bare)
    html = json.dumps(app.build(bare).config, default=str)
    assert "python -m ssd_core.calibrate" in html           # the banner says how an admin calibrates


# --- caps --------------------------------------------------------------------------------------------
def test_caps_take_the_space_column_then_variables_then_flags():
    assert Limits.resolve(env={}).public is False
    space = Limits.resolve(env={"SPACE_ID": "a/b"})
    assert space.public and all(getattr(space, n) == c.space for n, c in CAPS.items())
    local = Limits.resolve(env={})
    assert all(getattr(local, n) == c.local for n, c in CAPS.items())
    raised = Limits.resolve(env={"SPACE_ID": "a/b", "SSD_MAX_NEW_TOKENS": "400"},
                            overrides=vlimits.parse_overrides(["queue-size=5"]))
    assert raised.max_new_tokens == 400 and raised.queue_size == 5 and raised.race_max_new_tokens == 128
    for bad in ("0", "-3", "lots"):
        with pytest.raises(ValueError, match="max_new_tokens"):
            Limits.resolve(env={"SSD_MAX_NEW_TOKENS": bad})
    with pytest.raises(ValueError, match="one of"):
        vlimits.parse_overrides(["tokens=5"])
    table = vlimits.caps_markdown()
    assert all(f"`{c.env}`" in table for c in CAPS.values())


def test_the_docs_caps_table_is_the_one_the_code_enforces():
    assert vlimits.caps_markdown() in (ROOT / "docs" / "space.md").read_text(encoding="utf-8")


def test_over_a_cap_a_visitor_reads_a_sentence(studio, monkeypatch):
    small = dataclasses.replace(studio.limits, max_new_tokens=16, race_max_new_tokens=8, replay_steps=2)
    monkeypatch.setattr(studio, "limits", small)
    out = list(handlers.generate(studio, None, PROMPT, "KNN-SSD", None, 64, 3, 0.0, 0.0, 1.0, 5))
    assert len(out) == 1 and "between 1 and 16" in out[0]["tokens"]
    assert "between 1 and 16" in api_handlers.generate_text(studio, PROMPT, max_new_tokens=64)["error"]
    raced = list(race_handlers.race(studio, None, PROMPT, "KNN-SSD", None, 16, 3, 0.0, 0.0, 1.0, 5))
    run = raced[-1]["session"].run
    assert run.config.max_new_tokens == 8 and any("each lap stops at 8" in o.get("stats", "") for o in raced)
    path = _saved(raced[-1]["trace_file"])
    out = list(th.replay(studio, None, path, "instant"))
    assert len(out) == 1 and "replays at most 2" in out[0]["tokens"]


def test_the_layout_follows_the_caps(studio, monkeypatch):
    monkeypatch.setattr(studio, "limits", dataclasses.replace(studio.limits, max_new_tokens=40))
    demo = app.build(studio)
    sliders = [c["props"] for c in demo.config["components"] if c["props"].get("label") == "max new tokens"]
    assert sliders[0]["maximum"] == 40 and sliders[0]["value"] <= 40


def test_one_visitor_may_not_hold_more_than_the_in_flight_cap():
    def event(session):
        return SimpleNamespace(session_hash=session)
    pushed = []

    async def push(body, request, username=None):
        pushed.append(body.session_hash)
        return True, "id", "success"
    queue = SimpleNamespace(push=push, active_jobs=[None, [event("a")]],
                            event_queue_per_concurrency_id={"model": SimpleNamespace(queue=[event("a"), event("b")])})
    adapter.gate_per_visitor(queue, 2)
    ok, message, status = asyncio.run(queue.push(SimpleNamespace(session_hash="a"), None))
    assert not ok and status == "error" and "2 requests running or waiting" in message
    assert asyncio.run(queue.push(SimpleNamespace(session_hash="b"), None))[0] and pushed == ["b"]


# --- lanes ------------------------------------------------------------------------------------------------
def test_only_model_work_holds_the_model_lane(studio):
    demo = app.build(studio)
    by_name = {f.api_name: f for f in demo.fns.values()}
    model = {n for n, f in by_name.items() if f.concurrency_id == "model"}
    assert {"generate", "race", "walk_start", "generate_text"} <= model
    assert not {"replay", "walk_auto", "walk_next"} & model
    for name in ("replay", "walk_auto"):
        assert by_name[name].concurrency_limit and by_name[name].concurrency_limit > 1
    # every visitor's model work is a row of the engine's one batch: the lane admits max_rows at once
    assert all(by_name[n].concurrency_limit == studio.limits.max_rows for n in model)


def test_the_batch_caps_parse_and_a_class_of_30_racing_fits_the_queue():
    space = Limits.resolve(env={"SPACE_ID": "a/b"})
    assert (space.max_rows, space.kv_budget_mb) == (16, 768)
    assert Limits.resolve(env={}).kv_budget_mb == 2048
    set_ = Limits.resolve(env={"SPACE_ID": "a/b", "SSD_MAX_ROWS": "8"},
                          overrides=vlimits.parse_overrides(["kv-budget-mb=512"]))
    assert (set_.max_rows, set_.kv_budget_mb) == (8, 512)
    with pytest.raises(ValueError, match="max_rows"):
        Limits.resolve(env={"SSD_MAX_ROWS": "0"})
    assert 30 - space.max_rows <= space.queue_size          # 30 races: max_rows run, the rest wait in the queue


def test_a_walk_keeps_steps_not_a_live_decode(studio):
    out = wh.walk_start(studio, None, PROMPT, "KNN-SSD", "translation", 3, 5)
    walk = out["session"].walk
    assert isinstance(walk.steps, tuple) and all(isinstance(s, Step) for s in walk.steps)
    assert len(walk.steps) >= 1 and not any(hasattr(v, "gi_frame") for v in vars(walk).values())
    seen = []
    session = out["session"]
    while not session.walk.done:
        seen.append(session.walk.step)
        wh.walk_next(studio, session)
    assert tuple(seen) == walk.steps


def test_a_replay_never_lasts_longer_than_its_cap():
    waits = th.pauses([0.5] * 100 + [30.0], 0.5, 10.0)
    assert sum(waits) == pytest.approx(10.0) and max(waits) <= th.MAX_PAUSE_S
    assert th.pauses([0.1, 0.2], 1.0, 10.0) == [0.1, 0.2] and th.pauses([0.1, 5.0], None, 10.0) == [0.0, 0.0]


# --- memory and files ---------------------------------------------------------------------------------------
def _saved(link: str) -> str:
    payload = re.search(r'href="data:application/json;base64,([^"]+)"', link).group(1)
    path = Path(tempfile.mkdtemp()) / "t.json"
    path.write_bytes(base64.b64decode(payload))
    return str(path)


def test_a_run_writes_no_file_its_trace_travels_in_the_link(studio):
    before = set(Path(tempfile.gettempdir()).rglob("*.json"))
    out = list(handlers.generate(studio, None, *SETTINGS))
    assert set(Path(tempfile.gettempdir()).rglob("*.json")) == before
    trace = Trace.load(_saved(out[-1]["trace_file"]))
    assert trace.token_ids == out[-1]["session"].run.token_ids


def test_an_uploaded_trace_is_deleted_once_read_and_replays_again(studio, tmp_path, monkeypatch):
    """The page sends the upload's bytes; Gradio's copy (in a folder named by its hash of them) is deleted
    once read, and a second replay of the same content, by this visitor or another, still plays."""
    from gradio import processing_utils
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    monkeypatch.setattr(th.time, "sleep", lambda s: None)
    content = Path(_saved(list(handlers.generate(studio, None, *SETTINGS))[-1]["trace_file"])).read_bytes()
    upload = tmp_path / "gradio" / processing_utils.hash_bytes(content) / "t.json"
    upload.parent.mkdir(parents=True)
    upload.write_bytes(content)
    other = tmp_path / "gradio" / ("0" * 64) / "other.json"            # someone else's upload
    other.parent.mkdir()
    other.write_text("{}")
    first = list(th.replay(studio, None, content, "instant", discard=adapter.upload_forgetter(0)))
    assert not upload.parent.exists() and other.exists()
    upload.parent.mkdir()
    upload.write_bytes(content)                                        # uploaded again by another visitor
    again = list(th.replay(studio, None, content, "instant", discard=adapter.upload_forgetter(0)))
    assert again[-1]["session"].run.token_ids == first[-1]["session"].run.token_ids and not upload.exists()
    vlimits.forget_upload("../../etc")                                 # only hash-named folders, ever
    assert (tmp_path / "gradio").exists() and other.exists()


def test_a_later_delete_waits_and_restarts_for_the_same_upload(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path))
    folder = tmp_path / ("a" * 64)
    folder.mkdir()
    later = vlimits.LaterDelete(0.3)
    later("a" * 64)
    time.sleep(0.2)
    later("a" * 64)                           # read again: the clock starts over
    time.sleep(0.2)
    assert folder.exists() and later.pending() == 1
    time.sleep(0.4)
    assert not folder.exists() and later.pending() == 0


def test_session_state_has_a_time_to_live(studio):
    demo = app.build(studio)
    states = [b for b in demo.blocks.values() if type(b).__name__ == "State"]
    assert states and all(s.time_to_live == studio.limits.session_ttl_s for s in states)


# --- small holes --------------------------------------------------------------------------------------------
def test_sampling_seeds_differ_per_request_unless_the_visitor_sets_one(studio):
    a = api_handlers.generate_text(studio, PROMPT, max_new_tokens=12, temperature=1.0)
    b = api_handlers.generate_text(studio, PROMPT, max_new_tokens=12, temperature=1.0)
    assert a["seed"] != b["seed"]
    c = api_handlers.generate_text(studio, PROMPT, max_new_tokens=12, temperature=1.0, seed=a["seed"])
    assert c["text"] == a["text"] and c["seed"] == a["seed"]
    assert "seed" in api_handlers.generate_text(studio, PROMPT, temperature=1.0, seed=-1)["error"]
    out = list(handlers.generate(studio, None, PROMPT, "KNN-SSD", None, 8, 3, 0.0, 1.0, 1.0, 5, seed=7))
    assert out[-1]["session"].run.config.seed == 7


def test_a_trace_with_negative_or_nonsense_times_replays(studio, tmp_path, monkeypatch):
    slept = []
    monkeypatch.setattr(th.time, "sleep", slept.append)
    d = json.loads(Path(_saved(list(handlers.generate(studio, None, *SETTINGS))[-1]["trace_file"])).read_text())
    for s in d["steps"]:
        s["draft_s"], s["verify_s"] = -5.0, -1e9
    d["compute_s"] = -3.0
    f = tmp_path / "t.json"
    f.write_text(json.dumps(d))
    out = list(th.replay(studio, None, str(f), "1×"))
    assert out[-1]["session"].run is not None and all(s >= 0 for s in slept)


def test_a_one_entry_verify_table_plans(studio):
    lat = LatencyModel.from_dict({**studio.calibration.latency.to_dict(), "verify": {"1": 1.0}})
    assert lat.verify_cost(5) == 1.0 and lat.verify_cost(1) == 1.0
    assert 1 <= lat.best_gamma(studio.calibration.static, 0.7, 6) <= 6


def test_a_decode_that_raises_is_a_message_and_the_server_keeps_serving(studio, monkeypatch):
    def broken(*a, **kw):
        raise RuntimeError("simulated kernel failure at /root/secret/path")
        yield
    from ssd_core.engine import race as core_race
    monkeypatch.setattr(handlers, "decode", broken)
    monkeypatch.setattr(core_race, "decode", broken)          # the races' laps
    out = list(handlers.generate(studio, None, *SETTINGS))
    assert "model failed" in out[-1]["tokens"] and "/root" not in out[-1]["tokens"]
    raced = list(race_handlers.race(studio, None, *SETTINGS))
    assert "model failed" in raced[-1]["tokens"] and "race stopped" in raced[-1]["race"]
    monkeypatch.setattr(api_handlers, "core_generate", lambda *a, **kw: broken().__next__())
    assert "model failed" in api_handlers.generate_text(studio, PROMPT)["error"]
    monkeypatch.setattr(wh, "decode", broken)
    assert "model failed" in wh.walk_start(studio, None, PROMPT, "KNN-SSD", None, 3, 5)["walk"]


def test_a_race_that_parts_at_a_near_tie_says_so():
    race = vstats.RaceResult("KNN-SSD", 20.0, 30.0, 64, 64, False, first_difference=11, tie_gap=3e-5)
    html = vstats.race_html(race)
    assert "near-tie" in html and "3.0e-05" in html and "token 12" in html and "✗" not in html
    real = vstats.race_html(dataclasses.replace(race, tie_gap=2.5))
    assert "✗" in real and "not a tie" in real and "near-tie" not in real
    assert "✗" in vstats.race_html(dataclasses.replace(race, tie_gap=None))


def test_logit_gap_is_the_models_own_top_two_gap(tiny):
    ids = tiny.encode(PROMPT).ids
    gap = logit_gap(tiny, ids[:-3], ids[-3:])
    with torch.inference_mode():
        logits = tiny.hf_model(torch.tensor([ids])).logits[0, -1].float()
    top = torch.topk(logits, 2)
    assert gap.top == (int(top.indices[0]), int(top.indices[1]))
    assert gap.gap == pytest.approx(float(top.values[0] - top.values[1]), abs=1e-3)
    assert gap.near_tie == (gap.gap < NEAR_TIE)


def test_the_race_measures_the_gap_where_texts_part(studio, monkeypatch):
    real_decode = handlers.decode

    def ar_goes_elsewhere(bb, prompt, strategy, cfg, should_stop=None, **kw):     # kw: lookahead (engine.race)
        for ev in real_decode(bb, prompt, strategy, cfg, should_stop=should_stop, **kw):
            if strategy.name == "ar" and isinstance(ev, Step) and ev.index == 2:
                ev = dataclasses.replace(ev, committed=tuple((t + 1) % bb.vocab for t in ev.committed))
            yield ev
    from ssd_core.engine import race as core_race
    monkeypatch.setattr(core_race, "decode", ar_goes_elsewhere)      # both laps decode there
    raced = list(race_handlers.race(studio, None, *SETTINGS))
    result = raced[-1]["session"].race
    assert result.identical is False and result.first_difference is not None and result.tie_gap is not None
    assert "texts" in raced[-1]["race"]


CONCURRENT_MAP = """
import os, sys, threading
os.environ["NUMBA_THREADING_LAYER"] = "workqueue"          # as the app sets it (viz.studio)
sys.path.insert(0, {root!r})
import numpy as np
from ssd_core.calibration.umap_map import DomainMap
rng = np.random.default_rng(0)
dm = DomainMap.fit(rng.normal(size=(60, 16)).astype("float32"))
dm.warm()
def place():
    for _ in range(40):
        dm.transform(rng.normal(size=16))
threads = [threading.Thread(target=place) for _ in range(6)]
[t.start() for t in threads]
[t.join() for t in threads]
print("placed")
"""


@pytest.mark.slow
def test_the_domain_map_places_prompts_from_many_lanes_at_once():
    """Replays and a Generate place prompts on the map from different threads; numba's workqueue layer
    aborts the process on concurrent entry (the load test caught it), so placements take turns."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", CONCURRENT_MAP.format(root=str(ROOT))], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "placed" in done.stdout, done.stderr[-2000:]


def test_a_replay_sends_a_few_updates_a_second_and_always_the_last(monkeypatch):
    updates = [{"tokens": i} for i in range(7)] + [{"stats": "done"}]
    monkeypatch.setattr(handlers.time, "monotonic", iter([0.0, 0.1, 0.2, 0.3, 0.35, 0.6, 0.61, 0.62]).__next__)
    out = list(handlers.coalesce(updates, every_s=th.UPDATE_EVERY_S))
    assert out == [{"tokens": 0}, {"tokens": 3}, {"tokens": 5}, {"tokens": 6, "stats": "done"}]
