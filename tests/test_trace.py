"""Traces: a run written as JSON reads back exactly, and a wrong file gets a message, not a traceback."""
import json

import pytest
import torch

from ssd_core.engine.decode import DecodeConfig, Start
from ssd_core.engine.generate import generate
from ssd_core.engine.trace import FORMAT, VERSION, Trace, TraceError, record
from ssd_core.policies.registry import build as build_strategy

PROMPT = "Sum 3 and 4, then say why."


def _trace(tiny, tiny_calibration, name="knn", **cfg_kw):
    cfg = DecodeConfig(max_new_tokens=24, gamma=3, **cfg_kw)
    gen = generate(tiny, PROMPT, build_strategy(tiny_calibration, name, gamma=3), cfg)
    return gen, record(tiny, PROMPT, name, cfg, gen.start, gen.steps, gen.stats.wall_s, created="now")


def _same_start(a: Start, b: Start) -> None:
    for f in ("prompt_len", "first_token", "prefill_s", "strategy", "truncated", "draft", "skip", "domain",
              "route", "forecast"):
        assert getattr(a, f) == getattr(b, f), f
    assert a.embedding.dtype == b.embedding.dtype and torch.equal(a.embedding, b.embedding)


@pytest.mark.parametrize("name,cfg", [("knn", {}), ("knapspec", {}), ("ar", {}),
                                      ("static", {"temperature": 0.8, "top_p": 0.9, "seed": 3}),
                                      ("static", {"draft": "fp32", "lookup": False})])
def test_a_trace_round_trips_exactly(tiny, tiny_calibration, tmp_path, name, cfg):
    gen, trace = _trace(tiny, tiny_calibration, name, **cfg)
    text = trace.to_json()
    back = Trace.load(trace.save(tmp_path / "run.json"))
    assert back.to_json() == text                      # byte for byte
    assert back.steps == gen.steps                     # every field of every Step, floats to the bit
    _same_start(back.start, gen.start)
    assert back.config == trace.config and back.meta == {"created": "now"}
    assert back.token_ids == gen.token_ids and back.text == gen.text
    assert back.stats == gen.stats
    assert all(back.token_str(i) == tiny.token_str(i) for i in back.token_ids)


def test_a_trace_holds_what_the_issue_lists(tiny, tiny_calibration):
    _, trace = _trace(tiny, tiny_calibration, "knn")
    d = json.loads(trace.to_json())
    assert d["format"] == FORMAT and d["version"] == VERSION and d["model"] == tiny.name
    assert d["start"]["route"]["neighbours"] and d["start"]["skip"] is not None
    spec = [s for s in d["steps"] if s["drafted"]]
    assert spec, "the tiny knn run drafted nothing"
    for s in spec:
        assert len(s["draft_probs"]) == len(s["drafted"])
        assert len(s["verify_probs"]) == len(s["verified"]) and all(0 < p <= 1 for p in s["verify_probs"])
        assert {"draft_s", "verify_s", "overhead_s", "accepted", "committed", "skip"} <= set(s)


def _broken(trace: Trace, edit) -> str:
    d = json.loads(trace.to_json())
    edit(d)
    return json.dumps(d)


@pytest.mark.parametrize("edit,message", [
    (lambda d: d.update(format="something-else"), "not a KNN-SSD Studio trace"),
    (lambda d: d.update(version=VERSION + 1), "newer KNN-SSD Studio"),
    (lambda d: d.update(version="1"), "integer \"version\""),
    (lambda d: d.pop("steps"), 'the field "steps" is missing'),
    (lambda d: d["steps"][0].update(accepted="two"), "steps[0].accepted: expected an integer"),
    (lambda d: d["steps"][0].update(index=5), "out of order"),
    (lambda d: d["steps"][0].update(draft_probs=[]), "draft probabilities"),
    (lambda d: d["start"].update(extra=1), "unknown field(s) 'extra'"),
    (lambda d: d["config"].update(gamma=0), "gamma"),
    (lambda d: d["tokens"].clear(), "no text"),
    (lambda d: d["start"]["embedding"].update(shape=[3]), "does not hold"),
])
def test_a_malformed_trace_says_what_is_wrong(tiny, tiny_calibration, edit, message):
    _, trace = _trace(tiny, tiny_calibration, "static")
    with pytest.raises(TraceError, match=None) as err:
        Trace.from_json(_broken(trace, edit))
    assert message in str(err.value)


@pytest.mark.parametrize("data,message", [
    (b"\x89PNG\r\n\x1a\n\x00\x00", "not UTF-8"),
    (b"{not json", "not valid JSON"),
    (b"[1, 2, 3]", "holds a list"),
    (b'{"question_id": 81, "category": "writing", "turns": ["Hi"]}', "not a KNN-SSD Studio trace"),
    (b"[" * 100_000 + b"]" * 100_000, "too deeply"),
])
def test_a_foreign_file_gets_a_clear_message(data, message):
    with pytest.raises(TraceError) as err:
        Trace.from_json(data)
    assert message in str(err.value)
