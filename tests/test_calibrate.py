"""calibrate end to end on the tiny model; artefact round-trip and the mismatch errors."""
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ssd_core import calibration as cal_io
from ssd_core.calibration import CalibrationError
from ssd_core.calibration.domains import DOMAIN_DIR, DOMAINS
from ssd_core.engine.generate import generate
from ssd_core.policies.ar import Autoregressive
from ssd_core.policies.registry import AUTO_INNER, STRATEGIES
from ssd_core.policies.registry import build as build_strategy
from tiny import tiny_backbone


def test_calibration_has_every_artefact(tiny_calibration):
    cal = tiny_calibration
    assert set(cal.domain_sets) == set(DOMAINS)
    assert cal.static.name == "static"
    for name, skip in [*cal.domain_sets.items(), ("static", cal.static)]:
        assert 0 not in skip.attn | skip.mlp and 4 not in skip.attn | skip.mlp
        assert set(cal.matchness[name]) == set(DOMAINS)
    assert {"user", "all", "used"} <= set(cal.routing)
    assert "overall" in cal.routing["user"]["accuracy"]
    from ssd_core.policies.knapspec import DEFAULT_KAPPA
    assert cal.knapspec["kappa"] > 0 and cal.knapspec["kappa"] != round(DEFAULT_KAPPA, 4)   # fitted, not the fallback
    for f in ("calibration.json", "router.npz", "domain_map.npz", "umap.joblib"):
        assert (cal.folder / f).exists()
    assert set(cal.meta["timings"]) == {"draft_head_s", "latency_s", "match_data_s", "search_s", "matchness_s",
                                        "router_s", "kappa_s", "umap_s", "total_s"}      # every step ran


def test_every_strategy_from_a_calibration_is_lossless(tiny, tiny_calibration):
    prompt = "Translate German to English: Guten Morgen."
    ar = generate(tiny, prompt, Autoregressive(), max_new_tokens=24)
    for name in STRATEGIES:
        strat = build_strategy(tiny_calibration, name, gamma=3, category="translation")
        g = generate(tiny, prompt, strat, max_new_tokens=24, gamma=3)
        assert g.token_ids == ar.token_ids, name
    plan = build_strategy(tiny_calibration, "knn").start(tiny, tiny.encode(prompt),
                                                  tiny.prefill(tiny.encode(prompt), tiny.new_cache(256)).embedding)
    assert plan.route is not None and plan.skip == plan.route.skip


@pytest.mark.parametrize("inner", AUTO_INNER)
def test_auto_wraps_each_allowed_strategy_losslessly(tiny, tiny_calibration, inner):
    prompt = "Translate German to English: Guten Morgen."
    ar = generate(tiny, prompt, Autoregressive(), max_new_tokens=24)
    strat = build_strategy(tiny_calibration, "auto", inner=inner, gamma=3, category="translation")
    assert strat.name == "auto" and strat.inner.name == inner
    g = generate(tiny, prompt, strat, max_new_tokens=24, gamma=3)
    assert g.token_ids == ar.token_ids
    # knapspec picks its first set at the first step, so auto starts without a forecast for it
    assert (g.start.forecast is None) == (inner == "knapspec")


@pytest.mark.parametrize("inner", ["auto", "ar", "fast"])
def test_auto_refuses_what_it_cannot_wrap(tiny_calibration, inner):
    with pytest.raises(ValueError, match="auto wraps one of"):
        build_strategy(tiny_calibration, "auto", inner=inner)


def test_round_trip_and_domain_map(tiny, tiny_calibration):
    again = cal_io.load(tiny_calibration.folder, tiny)
    assert again.domain_sets == tiny_calibration.domain_sets
    assert again.latency == tiny_calibration.latency
    dm = again.load_domain_map()
    assert dm.coords.shape == (len(again.router), 2)
    x, y = dm.transform(np.ones(tiny.hidden, dtype=np.float32))
    assert np.isfinite(x) and np.isfinite(y)


def _copy(cal, tmp_path):
    dst = tmp_path / "cal"
    shutil.copytree(cal.folder, dst)
    return dst


def test_missing_calibration_says_how_to_build_one(tmp_path):
    with pytest.raises(CalibrationError, match="python -m ssd_core.calibrate"):
        cal_io.load(tmp_path / "nothing-here")


def test_other_model_is_refused(tiny_calibration, tmp_path):
    other = tiny_backbone(layers=6)
    with pytest.raises(CalibrationError, match="6 layers"):
        cal_io.load(tiny_calibration.folder, other)


def test_stale_domain_files_are_refused(tiny_calibration, tmp_path):
    domains = tmp_path / "domains"
    shutil.copytree(DOMAIN_DIR, domains)
    with open(domains / "qa.jsonl", "a") as f:
        f.write(json.dumps({"prompt": "A new question?"}) + "\n")
    with pytest.raises(CalibrationError, match="other domain prompt files"):
        cal_io.load(tiny_calibration.folder, domain_dir=domains)


def test_tampered_files_are_refused(tiny_calibration, tmp_path):
    folder = _copy(tiny_calibration, tmp_path)
    with open(folder / "router.npz", "ab") as f:
        f.write(b"junk")
    with pytest.raises(CalibrationError, match="checksum mismatch"):
        cal_io.load(folder)


def test_corrupt_json_is_refused(tiny_calibration, tmp_path):
    folder = _copy(tiny_calibration, tmp_path)
    (folder / "calibration.json").write_text("{not json")
    with pytest.raises(CalibrationError, match="corrupt"):
        cal_io.load(folder)


def test_tampered_umap_is_never_unpickled(tiny_calibration, tmp_path):
    from ssd_core.calibration.umap_map import DomainMapError
    folder = _copy(tiny_calibration, tmp_path)
    cal = cal_io.load(folder)
    (folder / "umap.joblib").write_bytes(b"not a pickle at all")
    with pytest.raises((DomainMapError, CalibrationError)):
        cal.load_domain_map()


# --- atomic writes: an interrupted calibration leaves the previous one intact ------------------------
def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _temporaries(folder):
    return [p.name for p in folder.iterdir() if cal_io.TMP_MARK in p.name]


def test_calibration_leaves_no_temporaries(tiny_calibration):
    folder = tiny_calibration.folder
    assert (folder / "search_history.json").exists()
    assert json.loads((folder / "search_history.json").read_text())["static"]
    assert _temporaries(folder) == []


@pytest.mark.parametrize("exc", [OSError("No space left on device"), KeyboardInterrupt()],
                         ids=["disk-full", "ctrl-c"])
@pytest.mark.parametrize("where", ["router.npz", "search_history.json", "calibration.json"])
def test_interrupted_save_keeps_the_previous_calibration(tiny, tiny_calibration, tmp_path, monkeypatch,
                                                         where, exc):
    folder = _copy(tiny_calibration, tmp_path)
    before = _snapshot(folder)
    cal = cal_io.load(folder, tiny)
    cal.meta["created"] = "the interrupted run"
    extra = {"search_history.json": {"static": []}} if where != "calibration.json" else None

    real_savez, real_dump = np.savez, json.dump

    def savez_half(f, **arrays):                  # write half of the real bytes, then die
        buf = io.BytesIO()
        real_savez(buf, **arrays)
        f.write(buf.getvalue()[:len(buf.getvalue()) // 2])
        raise exc

    def dump_half(obj, f, **kw):
        text = json.dumps(obj, **kw)
        f.write(text[:len(text) // 2])
        raise exc

    if where == "router.npz":
        monkeypatch.setattr(np, "savez", savez_half)
    else:
        monkeypatch.setattr(json, "dump", dump_half)
    with pytest.raises(type(exc)):
        cal_io.save(cal, folder, extra_json=extra)
    monkeypatch.undo()

    assert _snapshot(folder) == before             # every file as it was, nothing added
    assert _temporaries(folder) == []
    again = cal_io.load(folder, tiny)
    assert again.meta["created"] == tiny_calibration.meta["created"]
    # and the folder still takes a complete save
    cal_io.save(cal, folder)
    assert cal_io.load(folder, tiny).meta["created"] == "the interrupted run"
    assert _temporaries(folder) == []


KILLED_WRITER = r"""
import json, os, signal, sys
from ssd_core import calibration as cal_io
folder = sys.argv[1]
cal = cal_io.load(folder)
cal.meta["created"] = "killed"
real = json.dumps
def dying_dump(obj, f, **kw):
    text = real(obj, **kw)
    f.write(text[: len(text) // 2])
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)          # no cleanup runs: like a power cut or the OOM killer
json.dump = dying_dump
cal_io.save(cal, folder)
"""


@pytest.mark.skipif(os.name == "nt", reason="SIGKILL is POSIX")
def test_killed_calibration_leaves_only_a_hidden_temporary_that_the_next_save_sweeps(tiny, tiny_calibration,
                                                                                     tmp_path):
    folder = _copy(tiny_calibration, tmp_path)
    before = _snapshot(folder)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(folder)], cwd=root, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    left = _temporaries(folder)
    # the staged router.npz and the half-written calibration.json: hidden names, never an artefact's
    assert sorted(n.split(cal_io.TMP_MARK)[0] for n in left) == [".calibration.json", ".router.npz"]
    assert {n: b for n, b in _snapshot(folder).items() if n not in left} == before
    assert cal_io.load(folder, tiny).meta["created"] == tiny_calibration.meta["created"]
    # the writer is dead: the next save removes its temporary
    cal = cal_io.load(folder, tiny)
    cal_io.save(cal, folder)
    assert _temporaries(folder) == []
    assert cal_io.load(folder, tiny).meta["created"] == tiny_calibration.meta["created"]


def test_atomic_write_replaces_whole_files_or_nothing(tmp_path):
    path = tmp_path / "doc.json"
    with cal_io.atomic_write(path, "w", encoding="utf-8") as f:
        f.write('{"v": 1}')
    assert json.loads(path.read_text()) == {"v": 1}
    with pytest.raises(RuntimeError):
        with cal_io.atomic_write(path, "w", encoding="utf-8") as f:
            f.write('{"v": 2, "half')
            raise RuntimeError("interrupted")
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["doc.json"]
    # a temporary of a live process is left alone; one of a dead process is swept
    live = tmp_path / f".doc.json{cal_io.TMP_MARK}{os.getpid()}-0000"
    live.write_text("in progress")
    assert cal_io.remove_stale_temporaries(tmp_path) == [] and live.exists()


def test_domain_map_files_are_written_atomically(tmp_path, monkeypatch):
    from ssd_core.calibration.umap_map import COORDS_FILE, DomainMap
    dm = DomainMap.coords_only(np.zeros((5, 2), dtype=np.float32))
    dm.save(tmp_path)
    before = _snapshot(tmp_path)

    def broken(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", broken)
    with pytest.raises(OSError):
        DomainMap.coords_only(np.ones((5, 2), dtype=np.float32)).save(tmp_path)
    assert _snapshot(tmp_path) == before and list(before) == [COORDS_FILE]


def test_domain_check_compares_each_set_with_static_on_its_own_domain():
    from ssd_core.calibration.build import check_domain_sets
    matrix = {"math": {"math": 0.80, "qa": 0.40}, "qa": {"math": 0.50, "qa": 0.61},
              "static": {"math": 0.70, "qa": 0.60}}
    check = check_domain_sets(matrix, {"math": None, "qa": None}, margin=0.02)
    assert check["math"] == {"own": 0.8, "static": 0.7, "other": 0.4, "gain": 0.1, "passed": True}
    assert check["qa"]["passed"] is False and check["qa"]["gain"] == 0.01    # beats static, not by 0.02
    assert check_domain_sets(matrix, {"qa": None}, margin=0.0)["qa"]["passed"] is True


@pytest.mark.slow
def test_a_domain_that_fails_the_check_routes_to_static_and_says_so(tiny, tmp_path, caplog):
    """KNN-SSD mode with an impossible margin: every domain fails, loudly, and ships the static set."""
    from ssd_core.calibration.build import calibrate
    out = tmp_path / "tiny"
    cal = calibrate(None, out, budget=4, gamma=3, prompts_per_domain=3, held_out_per_domain=2,
                    continuation_tokens=6, max_prompt_tokens=32, backbone=tiny,
                    profile_kw={"contexts": (16,), "verify_ks": (1, 2), "repeats": 1}, progress=False,
                    umap=False, search_mode="matchness", skip_ratio=0.3, check_margin=1.0, lookup_aware=True)
    check = cal.meta["check"]
    assert set(check) == set(DOMAINS) and not any(c["passed"] for c in check.values())
    for d, skip in cal.domain_sets.items():
        assert (skip.attn, skip.mlp) == (cal.static.attn, cal.static.mlp) and skip.name == d
        assert cal.matchness[d] == cal.matchness["static"]
        searched = cal.meta["searched_sets"][d]
        assert len(searched["attn"]) + len(searched["mlp"]) == 3       # 0.3 of 2 × 5 sublayers
    assert sum("CHECK FAILED for domain" in r.message for r in caplog.records) == len(DOMAINS)
    assert cal.meta["settings"]["search_mode"] == "matchness"
    assert cal.meta["settings"]["search_method"] == "greedy"     # recorded: matchness mode's one method
    # --lookup-aware: the check scored only the positions prompt lookup would not draft
    from ssd_core.calibration.domains import DOMAIN_DIR, load_prompts, split
    from ssd_core.calibration.matchness import build_match_data, matchness, model_drafted_only
    assert cal.meta["settings"]["lookup_aware"] is True
    draft, dropped = tiny.drafts.get("int8"), 0
    for d, prompts in load_prompts(DOMAIN_DIR).items():
        held = build_match_data(tiny, split(prompts)[1][:2], 6, 32, progress=False)
        scored = model_drafted_only(held)
        dropped += held.tokens - scored.tokens
        assert cal.matchness["static"][d] == round(matchness(tiny, cal.static, scored, draft), 4)
    assert dropped > 0        # else the check above could not tell scored from plain data
    assert not (out / ".search_memo.json").exists()          # a finished run leaves no memo
    outside = cal.routing["check_set"]                       # routing on assets/routing_check/
    assert outside["prompts"] >= 7 and "overall" in outside["accuracy"]


# --- the prompt embedding a calibration routes on (issue #31, docs/routing.md) ------------------------
def test_prefill_embeds_the_prompt_as_its_last_tokens_state(tiny):
    from ssd_core.engine.backbone import EMBEDDING
    assert EMBEDDING == "last_token"
    p = tiny.encode("how many moons does mars have")
    a, b = p.user_span
    assert 0 < a < b < len(p)                       # the chat template sits on both sides
    hidden = tiny.forward(p.ids, tiny.new_cache(64), logits="none")
    pre = tiny.prefill(p, tiny.new_cache(64))
    # the state the first token's logits come from: it has read the template and the whole prompt
    assert np.allclose(pre.embedding.numpy(), hidden[-1].numpy(), atol=1e-5)
    assert np.allclose(tiny.head_logits(pre.embedding[None])[0].numpy(), pre.logits.numpy(), atol=1e-4)
    assert pre.hidden is None                       # nothing else pooled or kept at a serving prefill
    kept = tiny.prefill(p, tiny.new_cache(64), keep_hidden=True)
    assert np.allclose(kept.hidden.numpy(), hidden.numpy(), atol=1e-5) and np.array_equal(kept.embedding.numpy(), kept.hidden[-1].numpy())


def test_calibration_records_its_embedding_kind(tiny, tiny_calibration):
    cal = cal_io.load(tiny_calibration.folder, tiny)
    assert cal.meta["embedding"] == cal.embedding == "last_token"
    assert cal.routing["used"] == "last" and cal.routing["embedding"] == "last_token"
    assert {"last", "user", "all"} <= set(cal.routing)   # the report still compares the poolings
    assert cal.router.center is not None            # centred by the anchors' mean direction


def _as_old_artefact(tiny, cal, folder):
    """Rewrite a calibration as one made before the embedding kind existed: no meta["embedding"], an
    uncentred router on user-token means (the prefill embedding of that time)."""
    from ssd_core.calibration.router import Router
    texts = {}
    for t, d, k in zip(cal.router.texts, cal.router.domains, cal.router.kinds):
        if k == "prompt":
            texts.setdefault(d, []).append(t)

    def user_mean(text):
        p = tiny.encode(text, max_tokens=48)
        a, b = p.user_span
        return tiny.prefill(p, tiny.new_cache(len(p) + 1), keep_hidden=True).hidden[a:b].mean(0).numpy()
    emb = {d: np.stack([user_mean(t) for t in ts]) for d, ts in texts.items()}
    old = Router.build(emb, texts, cal.domain_sets, cal.static, seed=0, threshold=-1.0)
    old = cal.router = old.with_settings(threshold=cal.router.threshold)
    cal.meta.pop("embedding")
    cal.meta.pop("files")
    cal_io.save(cal, folder)
    return old, emb


def test_an_old_artefact_is_refused_until_rebuild_router_moves_it(tiny, tiny_calibration, tmp_path):
    """A calibration routed on the user-token mean (no embedding recorded) cannot be served: the
    backbone no longer computes that embedding. Loading says so and names the fix, which works."""
    from ssd_core.calibration.build import rebuild_router
    folder = _copy(tiny_calibration, tmp_path)
    old, _ = _as_old_artefact(tiny, cal_io.load(folder, tiny), folder)
    with pytest.raises(CalibrationError, match=r"routes on the 'user_mean' prompt embedding, which this version "
                                               r"no longer computes \(only 'last_token'\); rebuild its router with "
                                               r"python -m ssd_core.calibrate --rebuild-router --out "):
        cal_io.load(folder, tiny)
    sets = dict(cal_io.load(folder, tiny, any_embedding=True).domain_sets)
    new = rebuild_router(folder, backbone=tiny, progress=False)
    assert new.embedding == "last_token" and new.router.center is not None
    assert new.domain_sets == sets                          # only the router changed
    dm = new.load_domain_map()                              # the map is fitted on the new anchors
    assert np.allclose(dm.model._raw_data, new.router.vectors)
    assert not np.allclose(old.vectors, new.router.vectors, atol=1e-3)
    assert new.routing["check_set"]["prompts"] >= 7
    prompt = "Translate German to English: Guten Morgen."
    ar = generate(tiny, prompt, Autoregressive(), max_new_tokens=16)
    cal = cal_io.load(folder, tiny)
    assert generate(tiny, prompt, build_strategy(cal, "knn", gamma=3), max_new_tokens=16, gamma=3).token_ids == ar.token_ids


@pytest.mark.parametrize("kind", ["user_mean", "cls_token"])
def test_an_embedding_kind_the_backbone_does_not_compute_is_refused_with_the_fix(tiny_calibration, tmp_path, kind):
    folder = _copy(tiny_calibration, tmp_path)
    doc = json.loads((folder / "calibration.json").read_text())
    doc["meta"]["embedding"] = kind
    (folder / "calibration.json").write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match=rf"routes on the '{kind}' prompt embedding, which this version no "
                                               rf"longer computes .*--rebuild-router --out {re.escape(str(folder))}"):
        cal_io.load(folder)


def test_rebuild_router_will_not_leave_a_stale_domain_map(tiny, tiny_calibration, tmp_path):
    from ssd_core.calibration.build import rebuild_router
    folder = _copy(tiny_calibration, tmp_path)
    before = (folder / "router.npz").read_bytes()
    with pytest.raises(ValueError, match="domain map"):
        rebuild_router(folder, backbone=tiny, progress=False, umap=False)
    assert (folder / "router.npz").read_bytes() == before
