"""The Benchmark tab's reading of assets/bench/: the headline run first, one entry per other run,
and the committed folder keeps only runs that the index and a docs page cite."""
import json
import re
from pathlib import Path

from viz import benchmark as vbench

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "assets" / "bench"


def _run(folder: Path, name: str, speedup: float, md: dict[str, str]) -> None:
    (folder / name).mkdir(parents=True)
    (folder / name / "summary.json").write_text(json.dumps({"model": name, "lossless": True, "strategies": {
        "ar": {"tokens_per_s": 10.0, "speedup": 1.0, "tau": 1.0, "alpha": 0.0},
        "knn": {"tokens_per_s": 10.0 * speedup, "speedup": speedup, "tau": 2.0, "alpha": 0.5}}}))
    for rel, text in md.items():
        (folder / name / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / name / rel).write_text(text)


def test_the_index_names_the_headline_and_it_comes_first(tmp_path):
    _run(tmp_path, "a_old", 0.5, {"results.md": "old run"})
    _run(tmp_path, "z_new", 1.3, {"gamma4/results.md": "fixed", "adaptive/results.md": "adaptive"})
    _run(tmp_path, "m_head", 1.2, {"results.md": "the headline"})
    (tmp_path / "README.md").write_text("# runs\n<!-- headline: m_head -->\n")
    bench = vbench.read_bench(tmp_path)
    assert bench["summary"]["model"] == "m_head" and bench["headline"] == "m_head"
    assert bench["summary_path"].startswith("headline run: ")
    labels = [label for label, _ in bench["markdown"]]
    texts = [text for _, text in bench["markdown"]]
    assert labels[0].startswith("Headline run:") and texts[0] == "the headline"
    assert labels[1].endswith("README.md")                      # the index, right after the headline
    assert len(labels) == 4                                     # one entry per run, not per file
    z = texts[labels.index(next(lb for lb in labels if lb.endswith("z_new/")))]
    assert "#### adaptive/results.md" in z and "#### gamma4/results.md" in z and "fixed" in z
    assert "1.20×" in vbench.summary_html(bench["summary"], bench["summary_path"])


def test_without_an_index_the_first_run_in_name_order_leads(tmp_path):
    _run(tmp_path, "b", 0.9, {"results.md": "b"})
    _run(tmp_path, "a", 0.8, {"results.md": "a"})
    bench = vbench.read_bench(tmp_path)
    assert bench["summary"]["model"] == "a" and not bench["summary_path"].startswith("headline")
    (tmp_path / "README.md").write_text("<!-- headline: gone -->")    # names a run that is not there
    assert vbench.read_bench(tmp_path)["summary"]["model"] == "a"


def test_committed_bench_leads_with_its_headline_and_keeps_only_cited_runs():
    headline = vbench.headline_name(BENCH)
    assert headline and (BENCH / headline / "summary.json").exists()
    bench = vbench.read_bench(BENCH)
    assert bench["headline"] == headline and bench["summary"]["lossless"] is True
    assert bench["markdown"][0][0].startswith("Headline run:")
    index = (BENCH / "README.md").read_text(encoding="utf-8")
    docs = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs").glob("*.md"))
    for entry in BENCH.iterdir():
        if entry.name == "README.md":
            continue
        assert f"`{entry.name}" in index, f"assets/bench/{entry.name} is not in the index"
        assert entry.name in docs, f"no docs page cites assets/bench/{entry.name}"
    for cited in re.findall(r"^\| `([\w.]+)/?`", index, flags=re.M):     # the index lists no missing run
        assert (BENCH / cited).exists(), cited
