"""calibrate end to end on the tiny model; artefact round-trip and the mismatch errors."""
import json
import shutil

import numpy as np
import pytest

from ssd_core import calibration as cal_io
from ssd_core.calibration import CalibrationError
from ssd_core.domains import DOMAINS
from ssd_core.generate import generate
from ssd_core.strategies import Autoregressive
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
    assert cal.knapspec["kappa"] > 0
    for f in ("calibration.json", "router.npz", "domain_map.npz", "umap.joblib"):
        assert (cal.folder / f).exists()
    assert cal.meta["timings"]["total_s"] > 0


def test_every_strategy_from_a_calibration_is_lossless(tiny, tiny_calibration):
    prompt = "Translate German to English: Guten Morgen."
    ar = generate(tiny, prompt, Autoregressive(), max_new_tokens=24)
    for name in cal_io.STRATEGIES:
        strat = tiny_calibration.strategy(name, gamma=3, category="translation")
        g = generate(tiny, prompt, strat, max_new_tokens=24, gamma=3)
        assert g.token_ids == ar.token_ids, name
    assert "route" in tiny_calibration.strategy("knn").start(tiny, tiny.encode(prompt),
                                                              tiny.prefill(tiny.encode(prompt),
                                                                           tiny.new_cache(256)).embedding)


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
    shutil.copytree(cal_io.DOMAIN_DIR, domains)
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
    from ssd_core.domain_map import DomainMapError
    folder = _copy(tiny_calibration, tmp_path)
    cal = cal_io.load(folder)
    (folder / "umap.joblib").write_bytes(b"not a pickle at all")
    with pytest.raises((DomainMapError, CalibrationError)):
        cal.load_domain_map()
