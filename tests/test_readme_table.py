"""The README's results table is generated from committed runs (python -m viz.readme_table)."""
import json
from pathlib import Path

import pytest

from viz import readme_table as rt

ROOT = Path(__file__).resolve().parent.parent


def test_readme_table_equals_what_the_generator_writes_from_the_committed_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = rt.render(ROOT / "assets" / "bench")
    assert block in readme, "README.md's results table is stale: run python -m viz.readme_table"
    assert rt.main(["--check"]) == 0


def _bench(folder: Path, knn_speedup: float) -> None:
    (folder / "run").mkdir(parents=True, exist_ok=True)
    (folder / "README.md").write_text("<!-- headline: run -->\n")
    (folder / "run" / "summary.json").write_text(json.dumps({
        "lossless_vs_ar": True, "lossless_failures": [], "hf_generate_tokens_per_s": 8.0,
        "hf_generate_matches_ar": "3/3", "hf_generate_prompts": 3, "device": "cpu (2 threads)",
        "started": "2026-01-02T03:04:05", "settings": {"questions": "q.jsonl", "max_new_tokens": 16,
                                                      "draft_label": "int8 draft", "lookup": True,
                                                      "adaptive_gamma": True, "gamma": 4},
        "strategies": {"ar": {"tokens_per_s": 10.0, "speedup": 1.0, "tau": 1.0, "alpha": 0.0},
                       "knn": {"tokens_per_s": 10.0 * knn_speedup, "speedup": knn_speedup, "tau": 2.5,
                               "alpha": 0.6}}}))
    (folder / "baselines.json").write_text(json.dumps({
        "cpu": "Test CPU", "threads": 2, "n_gen": 128, "date": "2026-01-02 03:04 UTC",
        "load_note": {"loadavg_1min_start": 0.1, "loadavg_1min_end": 0.2, "cores": 2},
        "core": {"tokens_per_s": {"core_ar": 25.0}},
        "llama_cpp": {"tokens_per_s": {"Q4_1": {"tokens_per_s": 250.0, "stddev": 2.0}}}}))


def test_the_table_follows_the_committed_numbers(tmp_path):
    _bench(tmp_path, 1.25)
    block = rt.render(tmp_path)
    assert "| KNN-SSD (`knn`) | 12.5 | 1.25× | 2.50 | 0.60 | ✓ |" in block
    assert "| transformers `model.generate` (same run) | 8.0 | 0.80× |" in block
    assert "| llama.cpp Q4_1 (± 2.0) | 250.0 | 0.10× |" in block and "Test CPU" in block
    _bench(tmp_path, 0.75)                                         # numbers move → the table moves
    assert "| KNN-SSD (`knn`) | 7.5 | 0.75× |" in rt.render(tmp_path)


def test_refreshing_rewrites_only_the_block_and_check_sees_staleness(tmp_path):
    _bench(tmp_path, 1.25)
    readme = tmp_path / "README.md.test"
    readme.write_text(f"top\n{rt.START}\nold table\n{rt.END}\nbottom\n")
    args = ["--readme", str(readme), "--bench", str(tmp_path)]
    assert rt.main(args + ["--check"]) == 1
    assert rt.main(args) == 0
    text = readme.read_text()
    assert text.startswith("top\n" + rt.START) and text.endswith(rt.END + "\nbottom\n") and "old table" not in text
    assert rt.main(args + ["--check"]) == 0
    with pytest.raises(ValueError):
        rt.replace_block("no markers here", rt.render(tmp_path))


def test_the_baseline_table_shows_the_apps_decoding_and_the_pairs_spread(tmp_path):
    _bench(tmp_path, 1.25)
    base = json.loads((tmp_path / "baselines.json").read_text())
    base["pairs"] = 5
    base["core"] = {"tokens_per_s": {"core_ar": 20.0, "ssd": 24.0},
                    "heldout": {"core_ar": 21.0, "ssd": 24.0, "ssd_vs_core_ar": 1.14}}
    base["llama_cpp"]["tokens_per_s"]["F32"] = {"tokens_per_s": 30.0, "samples": [28.0, 30.0, 31.5]}
    (tmp_path / "baselines.json").write_text(json.dumps(base))
    block = rt.render(tmp_path)
    assert "median of 5 interleaved pairs" in block
    assert "| core AR on the app's held-out prompts (EOS on) | 21.0 | – | 1.14× (paired) |" in block
    assert "| llama.cpp F32 (28.0–31.5) | 30.0 | 0.67× | 0.80× |" in block
