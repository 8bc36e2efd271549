import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# shared CPUs: spinning threads starve each other. For the tests' own threads only: the app processes the
# tests start drop it (tests/test_browser.py, tests/loadtest.py), as a Space does not set it
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Everything the core caches (ssd_core.engine.machine.cache_dir: the verifier's kernel choices, converted
# models) goes to a folder of this test session, set before any test module imports the core and inherited
# by every process the tests start: a developer's warm ~/.cache/knn-ssd-studio (or their own KNN_SSD_CACHE)
# cannot make a test pass. Removed at the end of the session (pytest_unconfigure).
SESSION_CACHE = tempfile.mkdtemp(prefix="knn-ssd-test-cache-")
os.environ["KNN_SSD_CACHE"] = SESSION_CACHE

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tiny import tiny_backbone  # noqa: E402


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """A test that needs `tiny_calibration` (a full calibration of the tiny model: ~90 s on 2 busy
    cores, once per session) is slow: `make test-fast` (-m "not slow") leaves it out."""
    for item in items:
        if "tiny_calibration" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny():
    return tiny_backbone()


@pytest.fixture
def cached_tiny(tiny, tmp_path):
    """The tiny model saved as a warm model cache (what `load_backbone` writes after a GGUF conversion)."""
    from ssd_core.engine import loading
    folder = tmp_path / "tiny-cache"
    loading._save_plain(tiny.hf_model.state_dict(), tiny.hf_model.config, tiny.tokenizer, folder)
    return folder


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    """The empty model cache `real_model` converts the GGUF into (and later loads can read)."""
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="session")
def real_model(model_cache):
    """The embedded default model (marked tests only), converted from the GGUF into an empty cache:
    what a new machine does, so a warm cache in the developer's home cannot hide a broken conversion."""
    from ssd_core.engine.loading import load_backbone
    mp = pytest.MonkeyPatch()
    mp.setenv("KNN_SSD_CACHE", str(model_cache))
    try:
        return load_backbone(threads=2)
    finally:
        mp.undo()


@pytest.fixture(scope="session")
def tiny_calibration(tiny, tmp_path_factory):
    """A full calibration of the tiny model (small budgets: seconds, not minutes)."""
    from ssd_core.calibration.build import calibrate
    out = tmp_path_factory.mktemp("calibration") / "tiny"
    return calibrate(None, out, budget=6, gamma=3, prompts_per_domain=6, held_out_per_domain=4,
                     continuation_tokens=8, max_prompt_tokens=48, backbone=tiny,
                     profile_kw={"contexts": (16, 64), "verify_ks": (1, 2, 4), "repeats": 2},
                     progress=False)
