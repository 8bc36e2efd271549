"""The environment the tests run in and hand to the processes they start (tests/conftest.py): the core's
cache is a folder of this session, and the app runs without the tests' OMP_WAIT_POLICY."""
import os
import subprocess
import sys
from pathlib import Path

import loadtest
import test_browser
from ssd_core.engine import machine
from tiny import tiny_backbone

ROOT = Path(__file__).resolve().parents[1]


def test_the_session_caches_in_a_folder_of_its_own(monkeypatch):
    """A kernel choice (or a converted model) cached in the developer's home cannot make a test pass;
    processes the tests start inherit the session's folder."""
    monkeypatch.delenv("SSD_KERNEL", raising=False)
    cache = machine.cache_dir()
    assert cache.name.startswith("knn-ssd-test-cache-") and cache.is_dir(), cache
    assert not cache.is_relative_to(Path.home() / ".cache"), cache
    tiny_backbone()                                           # auto: its kernel choice is cached there
    assert (cache / machine.CHOICE_FILE).exists()
    child = subprocess.run([sys.executable, "-c", "from ssd_core.engine.machine import cache_dir; print(cache_dir())"],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert child.stdout.strip() == str(cache), child.stderr[-2000:]


def test_the_apps_the_tests_start_run_without_the_tests_omp_wait_policy(monkeypatch, tmp_path):
    """conftest sets OMP_WAIT_POLICY=PASSIVE for the tests' own threads; in the app it doubles an int8
    draft step, and a Space does not set it."""
    assert os.environ.get("OMP_WAIT_POLICY")
    browser = test_browser.app_env(tmp_path, 7861)
    assert "OMP_WAIT_POLICY" not in browser and "KNN_SSD_CACHE" not in browser     # caches under the empty HOME
    assert browser["HOME"] == str(tmp_path)
    started = []

    class Started:
        stdout = iter(())

        def __init__(self, cmd, env, **kw):
            started.append(env)
    monkeypatch.setattr(loadtest.subprocess, "Popen", Started)
    loadtest.Server(7862, tmp_path, {})
    env, = started
    assert "OMP_WAIT_POLICY" not in env and env["KNN_SSD_CACHE"] == os.environ["KNN_SSD_CACHE"]
    assert env["SPACE_ID"]
