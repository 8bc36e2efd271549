"""Traces in the app: every run downloads as a trace; a replay shows what the live run showed, without the
model; a wrong file gets a message in the token panel."""
import base64
import json
import re
import tempfile
from pathlib import Path

import pytest

from ssd_core.engine.trace import Trace
from viz import handlers
from viz import race_handlers
from viz import startup
from viz import studio as vstudio
from viz import trace_handlers as th
from viz import walk_handlers

PROMPT = "Translate German to English: Guten Morgen, wie geht es dir?"
SETTINGS = (PROMPT, "KNN-SSD", "translation", 32, 3, 0.0, 0.0, 1.0, 5)


@pytest.fixture(scope="module")
def studio(tiny, tiny_calibration):
    return startup.load_studio(backbone=tiny, calibration=tiny_calibration.folder, warm=False)


def last(outputs, name):
    value = [o[name] for o in outputs if name in o][-1]
    value = value.value if isinstance(value, vstudio.Update) else value
    return saved(value) if name == "trace_file" else value


def saved(link: str) -> str:
    """What the browser does with the download link: the trace inside it, as a file (its path)."""
    payload = re.search(r'href="data:application/json;base64,([^"]+)"', link)
    assert payload, link
    path = Path(tempfile.mkdtemp()) / re.search(r'download="([^"]+)"', link).group(1)
    path.write_bytes(base64.b64decode(payload.group(1)))
    return str(path)


def spans(html: str) -> list[str]:
    """The coloured tokens: every token span with its classes, text and tooltip."""
    return re.findall(r'<span class="tok [^"]*"[^>]*>.*?</span>', html)


@pytest.mark.parametrize("handler,label", [(handlers.generate, "KNN-SSD"), (race_handlers.race, "KnapSpec"),
                                           (handlers.generate, "autoregressive")])
def test_a_replay_shows_the_same_tokens_stats_and_route_as_the_live_run(studio, tiny, monkeypatch, handler,
                                                                        label):
    live = list(handler(studio, None, PROMPT, label, *SETTINGS[2:]))
    path = last(live, "trace_file")
    assert path and path.endswith(".json")
    trace = Trace.load(path)
    run = live[-1]["session"].run
    assert trace.token_ids == run.token_ids and trace.steps == tuple(run.steps)

    monkeypatch.setattr(th.time, "sleep", lambda s: None)          # pacing is tested below
    replayed = list(th.replay(studio, None, path, "4×"))
    assert spans(last(replayed, "tokens")) == spans(last(live, "tokens"))
    assert len(spans(last(live, "tokens"))) == len(run.token_ids) + sum(len(s.rejected) for s in run.steps)
    assert last(replayed, "route") == last(live, "route") and last(replayed, "prompt") == PROMPT
    assert th.REPLAY_OUTPUTS[:len(handlers.GEN_OUTPUTS)] == handlers.GEN_OUTPUTS   # app.py wires it so
    assert all(set(o) <= set(th.REPLAY_OUTPUTS) for o in replayed)
    again = replayed[-1]["session"].run
    assert again.stats == run.stats                                   # same τ, α, tokens/s (recorded times)
    if handler is race_handlers.race:
        assert "identical" in last(replayed, "race") and replayed[-1]["session"].race == live[-1]["session"].race
    # the replay can be downloaded again, unchanged
    assert Trace.load(last(replayed, "trace_file")).to_json() == trace.to_json()


def test_the_replay_becomes_the_step_through_walk(studio, monkeypatch):
    monkeypatch.setattr(th.time, "sleep", lambda s: None)
    path = last(list(handlers.generate(studio, None, *SETTINGS)), "trace_file")
    trace = Trace.load(path)
    out = list(th.replay(studio, None, path, "instant"))
    session = out[-1]["session"]
    assert "walk" in out[-1] and session.walk is not None and session.walk.step == trace.steps[0]
    seen = [session.walk.step]
    while not session.walk.done:
        walk_handlers.walk_next(studio, session)
        if session.walk.step is not None:
            seen.append(session.walk.step)
    assert tuple(seen) == trace.steps


def test_replay_paces_by_the_recorded_step_times(studio, monkeypatch):
    path = last(list(handlers.generate(studio, None, *SETTINGS)), "trace_file")
    trace = Trace.load(path)
    slept = []
    monkeypatch.setattr(th.time, "sleep", slept.append)
    list(th.replay(studio, None, path, "2×"))
    steps = [min(th.MAX_PAUSE_S, (s.draft_s + s.verify_s + s.overhead_s) / 2) for s in trace.steps]
    assert slept[1:] == pytest.approx(steps)
    slept.clear()
    list(th.replay(studio, None, path, "instant"))
    assert slept == []


@pytest.mark.parametrize("content,message", [
    ("{ nope", "not valid JSON"),
    ('{"question_id": 1, "turns": ["hi"]}', "not a KNN-SSD Studio trace"),
    ('{"format": "knn-ssd-studio/trace", "version": 99}', "newer KNN-SSD Studio"),
])
def test_a_wrong_file_is_a_message_not_a_traceback(studio, tmp_path, content, message):
    f = tmp_path / "x.json"
    f.write_text(content)
    out = list(th.replay(studio, None, str(f), "instant"))
    assert len(out) == 1 and message in out[0]["tokens"] and "⚠" in out[0]["tokens"]
    assert "⚠" in list(th.replay(studio, None, None))[0]["tokens"]


def test_a_trace_of_another_model_replays_without_map_or_layer_map(studio, monkeypatch, tmp_path):
    monkeypatch.setattr(th.time, "sleep", lambda s: None)
    path = last(list(handlers.generate(studio, None, *SETTINGS)), "trace_file")
    d = json.loads(open(path).read())
    d["model"] = "some-other-model"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(d))
    out = list(th.replay(studio, None, str(other), "instant"))
    assert "some-other-model" in last(out, "stats") and out[-1]["session"].run.foreign
    assert spans(last(out, "tokens"))


@pytest.mark.parametrize("edit,why", [
    (lambda d: d["start"]["route"]["neighbours"][0].update(index=10 ** 6), "another calibration"),
    (lambda d: d["start"]["route"]["neighbours"][0].update(text="an anchor this calibration never had"),
     "another calibration"),
    (lambda d: d["start"]["embedding"].update(shape=[2, len(d["start"]["embedding"]["values"]) // 2]),
     None),
])
def test_a_trace_from_another_calibration_replays_without_the_map(studio, monkeypatch, tmp_path, edit, why):
    monkeypatch.setattr(th.time, "sleep", lambda s: None)
    d = json.loads(open(last(list(handlers.generate(studio, None, *SETTINGS)), "trace_file")).read())
    edit(d)
    f = tmp_path / "t.json"
    f.write_text(json.dumps(d))
    out = list(th.replay(studio, None, str(f), "instant"))
    assert out[-1]["session"].run.foreign and spans(last(out, "tokens"))
    if why:
        assert why in last(out, "stats")


def test_a_hand_edited_race_result_is_dropped_not_drawn(studio, monkeypatch, tmp_path):
    monkeypatch.setattr(th.time, "sleep", lambda s: None)
    d = json.loads(open(last(list(race_handlers.race(studio, None, *SETTINGS)), "trace_file")).read())
    assert th._race(d["meta"]["race"]) is not None
    d["meta"]["race"]["tokens_per_s"] = "fast"
    f = tmp_path / "t.json"
    f.write_text(json.dumps(d))
    out = list(th.replay(studio, None, str(f), "instant"))
    assert out[-1]["session"].race is None and spans(last(out, "tokens"))
