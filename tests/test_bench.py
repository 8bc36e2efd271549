"""The Spec-Bench-compatible benchmark on the tiny model: files, keys, arithmetic, ordering, lossless."""
import json
from collections import Counter
from dataclasses import replace

import pytest

from ssd_core.policies.registry import parse_strategies
from ssd_core.tools import bench, reference, specbench, tau_ratio
from ssd_core.tools.specbench import Question, mix_order
from ssd_core.tools.metrics import aggregate, combine_predictions, median_speedup, speedup
from viz import bench_figures

CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
PROMPTS = {
    "mt_bench": ["Write a short note to a friend.", "Give two tips for sleeping well."],
    "translation": ["Translate German to English: Guten Morgen.", "Translate German to English: Danke."],
    "summarization": ["Summarize: The council met on Monday and agreed to repair the old bridge. " * 4,
                      "Summarize: Heavy rain closed two roads near the river for most of the day. " * 4],
    "qa": ["What is the capital of France?", "How many legs does a spider have?"],
    "math_reasoning": ["Tom has 3 apples and buys 5 more. How many now?", "What is 12 times 4?"],
    "rag": ["Context: The tower is 300 m tall. Question: How tall is the tower?",
            "Context: The lake freezes in January. Question: When does it freeze?"],
}
STRATEGIES = "ar,static,knn,oracle,knapspec,auto"


@pytest.fixture()
def question_file(tmp_path):
    path = tmp_path / "questions.jsonl"
    qid = 0
    with open(path, "w") as f:
        for cat in CATEGORIES:
            for p in PROMPTS[cat]:
                qid += 1
                f.write(json.dumps({"question_id": qid, "category": cat, "turns": [p]}) + "\n")
    return path


def _main(tiny, cal, questions, out, *extra):
    return bench.main(["--questions", str(questions), "--calibration", str(cal.folder), "--out", str(out),
                       "--max-new-tokens", "10", "--no-progress", *extra], backbone=tiny)


# --- a whole run through the CLI ----------------------------------------------------------------
def test_cli_writes_spec_bench_answers_and_a_complete_summary(tiny, tiny_calibration, question_file, tmp_path):
    out = tmp_path / "run"
    rc = _main(tiny, tiny_calibration, question_file, out, "--strategies", STRATEGIES,
               "--max-prompt-tokens", "200", "--mix-ratio", "0.5", "--seed", "3")
    assert rc == 0
    names = STRATEGIES.split(",")
    summary = json.loads((out / "summary.json").read_text())
    for key in ("model", "lossless", "strategies", "routing", "hf_generate_tokens_per_s", "ar_bandwidth_gb_s",
                "truncated_prompts", "settings", "order", "lossless_failures", "machine", "definitions"):
        assert key in summary, key
    assert summary["lossless"] is True and summary["lossless_failures"] == []
    assert summary["truncated_prompts"] == 2                 # the two long summarization prompts
    assert sorted(summary["order"]) == list(range(1, 13))
    for flag in ("max_new_tokens", "max_prompt_tokens", "mix_ratio", "seed", "limit", "categories",
                 "hf_generate_every", "gamma", "strategies", "calibration"):
        assert flag in summary["settings"], flag
    assert list(summary["strategies"]) == names
    for name, s in summary["strategies"].items():
        for key in ("tokens_per_s", "speedup", "speedup_median", "tau", "alpha", "predicted_speedup_measured_alpha",
                    "predicted_speedup_calibration_alpha", "per_category", "speedup_vs_hf_generate"):
            assert key in s, (name, key)
        assert set(s["per_category"]) == set(CATEGORIES)
        for c in s["per_category"].values():
            assert {"tokens_per_s", "speedup", "tau", "alpha"} <= set(c)
    ar = summary["strategies"]["ar"]
    assert ar["tau"] == 1.0 and ar["alpha"] == 0.0 and ar["speedup"] == 1.0
    assert summary["strategies"]["static"]["drafted"] > 0
    assert {c: sum(v.values()) for c, v in summary["routing"].items()} == {c: 2 for c in CATEGORIES}
    assert summary["hf_generate_tokens_per_s"] > 0 and summary["ar_bandwidth_gb_s"] > 0

    for name in names:
        lines = [json.loads(x) for x in (out / f"{name}.jsonl").read_text().splitlines()]
        assert [a["question_id"] for a in lines] == summary["order"]
        for a in lines:
            assert {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"} <= set(a)
            assert a["model_id"] == f"{tiny.name}-{name}"
            ch = a["choices"][0]
            assert ch["index"] == 0
            for key in ("turns", "new_tokens", "wall_time", "accept_lengths", "decoding_steps"):
                assert isinstance(ch[key], list) and len(ch[key]) == 1, key
            # the prefill's token plus every step's committed tokens
            assert ch["new_tokens"][0] == 1 + sum(ch["accept_lengths"][0])
            assert ch["decoding_steps"][0] == len(ch["accept_lengths"][0])
        assert len({a["answer_id"] for a in lines}) == len(lines)
    ar_turns = [json.loads(x)["choices"][0]["turns"] for x in (out / "ar.jsonl").read_text().splitlines()]
    knn_turns = [json.loads(x)["choices"][0]["turns"] for x in (out / "knn.jsonl").read_text().splitlines()]
    assert ar_turns == knn_turns
    assert summary["outputs"]["answers"] and not (out / "results.md").exists()   # the tool writes data only
    rendered = bench_figures.render(out)                                          # the views draw it
    md = (out / "results.md").read_text()
    assert "| knn |" in md and "τ" in md and "| knn |" in rendered["table"]
    for fig in ("tau_per_category", "speedup_per_category", "accept_lengths"):
        assert (out / f"{fig}.html").exists()
    # kaleido is optional: PNGs either exist or the renderer says why they were skipped
    figs = rendered["figures"]
    assert figs["png"] or figs["png_skipped"]


def test_limit_and_categories(tiny, tiny_calibration, question_file, tmp_path):
    out = tmp_path / "small"
    rc = _main(tiny, tiny_calibration, question_file, out, "--strategies", "ar,static", "--limit", "1",
               "--categories", "qa,translation", "--hf-generate-every", "0", "--no-figures")
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["order"] == [3, 7]                       # file order of categories, one each
    assert summary["hf_generate_tokens_per_s"] is None
    assert not (out / "results.md").exists()


def test_a_changed_token_fails_the_lossless_check(tiny, tiny_calibration, question_file, tmp_path,
                                                  monkeypatch, capsys):
    real = bench.generate

    def tampered(backbone, prompt, strategy=None, config=None):
        g = real(backbone, prompt, strategy, config)
        if getattr(strategy, "name", "") == "static":
            ids = g.token_ids[:-1] + ((g.token_ids[-1] + 1) % backbone.vocab,)
            g = replace(g, token_ids=ids, text=backbone.decode(ids))
        return g

    monkeypatch.setattr(bench, "generate", tampered)
    out = tmp_path / "broken"
    rc = _main(tiny, tiny_calibration, question_file, out, "--strategies", "ar,static,knn", "--limit", "1",
               "--no-figures", "--hf-generate-every", "0")
    assert rc == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lossless"] is False
    failures = summary["lossless_failures"]
    assert failures and {f["strategy"] for f in failures} == {"static"}
    assert {f["question_id"] for f in failures} == set(summary["order"])
    assert "LOSSLESS FAILURE: strategy static" in capsys.readouterr().err


# --- the arithmetic by hand -------------------------------------------------------------------
def _rec(tokens, wall, lengths, drafted=0, accepted=0, prefill=0.0, category="x", **kw):
    return {"new_tokens": tokens, "wall_s": wall, "prefill_s": prefill, "accept_lengths": lengths,
            "drafted": drafted, "accepted": accepted, "category": category, **kw}


def test_tau_alpha_and_tokens_per_s_by_hand():
    # prompt 1: 1 prefill token + steps committing 3, 1, 5 → 10 tokens in 2 s; 12 drafted, 6 accepted
    # prompt 2: 1 + 2 + 2 → 5 tokens in 3 s; 8 drafted, 2 accepted
    recs = [_rec(10, 2.0, [3, 1, 5], 12, 6, prefill=0.5), _rec(5, 3.0, [2, 2], 8, 2, prefill=1.0)]
    agg = aggregate(recs)
    assert agg["tokens_per_s"] == pytest.approx(15 / 5.0)            # 3.0, not mean(5.0, 1.67)
    assert agg["tau"] == pytest.approx(13 / 5)                        # pooled over the 5 steps
    assert agg["alpha"] == pytest.approx(8 / 20)
    assert agg["decode_tokens_per_s"] == pytest.approx(13 / 3.5)     # (2 − 0.5) + (3 − 1)
    assert aggregate([_rec(4, 1.0, [1, 1, 1])])["tau"] == 1.0        # autoregressive


def test_speedup_is_a_ratio_of_sums_over_the_same_prompts():
    ar = [_rec(10, 1.0, [1] * 9), _rec(10, 4.0, [1] * 9)]            # 20 tokens / 5 s = 4 tok/s
    spec = [_rec(10, 0.5, [3, 3, 3]), _rec(10, 5.0, [3, 3, 3])]      # 20 / 5.5 s
    assert speedup(spec, ar) == pytest.approx((20 / 5.5) / (20 / 5.0))   # 0.909…, below 1 and reported
    # not the mean of per-prompt ratios (2.0 and 0.8 → 1.4)
    assert speedup(spec, ar) != pytest.approx((2.0 + 0.8) / 2)
    # the robust companion: the median of the per-prompt ratios 2.0 and 0.8
    assert median_speedup(spec, ar) == pytest.approx(1.4)
    # one prompt hit by a burst of load (ar took 10× longer) moves the ratio of sums, not the median
    ar3 = [_rec(10, 1.0, []), _rec(10, 1.0, []), _rec(10, 10.0, [])]
    same = [_rec(10, 1.0, []), _rec(10, 1.0, []), _rec(10, 1.0, [])]
    assert speedup(same, ar3) == pytest.approx(12 / 3)
    assert median_speedup(same, ar3) == pytest.approx(1.0)


def test_predicted_speedups_combine_like_tokens_per_s():
    recs = [_rec(10, 1, [], predicted=2.0), _rec(30, 1, [], predicted=0.5)]
    # 40 tokens; predicted time in ar-token units: 10/2 + 30/0.5 = 65 → 40/65
    assert combine_predictions(recs, "predicted") == pytest.approx(40 / 65)
    assert combine_predictions([_rec(1, 1, [], predicted=None)], "predicted") is None


def test_per_category_numbers_in_a_run_match_the_answer_files(tiny, tiny_calibration, question_file, tmp_path):
    out = tmp_path / "check"
    assert _main(tiny, tiny_calibration, question_file, out, "--strategies", "ar,knn", "--no-figures",
                 "--hf-generate-every", "0") == 0
    summary = json.loads((out / "summary.json").read_text())
    answers = {n: [json.loads(x) for x in (out / f"{n}.jsonl").read_text().splitlines()] for n in ("ar", "knn")}
    for cat in CATEGORIES:
        tok = {n: sum(a["choices"][0]["new_tokens"][0] for a in answers[n] if a["category"] == cat)
               for n in answers}
        wall = {n: sum(a["choices"][0]["wall_time"][0] for a in answers[n] if a["category"] == cat)
                for n in answers}
        lengths = [k for a in answers["knn"] if a["category"] == cat for k in a["choices"][0]["accept_lengths"][0]]
        got = summary["strategies"]["knn"]["per_category"][cat]
        assert got["speedup"] == pytest.approx((tok["knn"] / wall["knn"]) / (tok["ar"] / wall["ar"]), rel=1e-3)
        assert got["tau"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-4)
        assert got["tokens_per_s"] == pytest.approx(tok["knn"] / wall["knn"], rel=1e-3)


# --- stream order ------------------------------------------------------------------------------
def _stream(per_cat=4, cats="abc"):
    return [Question(f"{c}{i}", c, "") for c in cats for i in range(per_cat)]


def test_mix_ratio_zero_gives_domain_blocks():
    order = mix_order(_stream(), 0.0, seed=5)
    assert "".join(q.category for q in order) == "aaaabbbbcccc"


def test_mix_ratio_one_switches_after_every_prompt():
    order = mix_order(_stream(), 1.0, seed=5)
    assert "".join(q.category for q in order) == "abcabcabcabc"
    assert [q.question_id for q in order[:3]] == ["a0", "b0", "c0"]   # file order within a category


def test_mixed_order_is_a_seeded_permutation():
    qs = _stream(per_cat=6)
    a, b = mix_order(qs, 0.5, seed=1), mix_order(qs, 0.5, seed=1)
    assert a == b                                                    # deterministic for a seed
    assert sorted(q.question_id for q in a) == sorted(q.question_id for q in qs)
    assert mix_order(qs, 0.5, seed=2) != a                           # the seed matters
    rate = specbench.switch_rate(a)
    assert specbench.switch_rate(mix_order(qs, 0.0)) < rate < specbench.switch_rate(mix_order(qs, 1.0))
    for cat in "abc":                                                # within a category, file order kept
        ids = [q.question_id for q in a if q.category == cat]
        assert ids == sorted(ids)


def test_select_limits_per_category():
    qs = _stream(per_cat=3)
    assert Counter(q.category for q in specbench.select(qs, limit=2)) == {"a": 2, "b": 2, "c": 2}
    assert {q.category for q in specbench.select(qs, categories=["b"])} == {"b"}
    with pytest.raises(ValueError, match="no questions"):
        specbench.select(qs, categories=["zzz"])
    with pytest.raises(ValueError, match="mix ratio"):
        mix_order(qs, 1.5)


def test_questions_in_spec_bench_format(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_text(json.dumps({"question_id": 7, "category": "qa", "turns": ["Hi?", "second turn"]}) + "\n\n")
    assert specbench.load_questions(p) == [Question(7, "qa", "Hi?")]
    p.write_text('{"question_id": 1}\n')
    with pytest.raises(ValueError, match="Spec-Bench question"):
        specbench.load_questions(p)
    with pytest.raises(ValueError, match="unknown strategies"):
        parse_strategies("ar,fast")
    assert parse_strategies("knn,static") == ["ar", "knn", "static"]


# --- scaling on the tiny model ------------------------------------------------------------------
def test_scaling_runs_and_records_knapspec_choices(tiny, tiny_calibration, tmp_path):
    from ssd_core.tools import scaling
    res = scaling.run_scaling(tiny, tiny_calibration, lengths=(128, 300), new_tokens=8, progress=False,
                              sweep_contexts=(64, 256, 900))
    assert res["lossless"]
    assert [abs(p["prompt_tokens"] - p["target_tokens"]) <= 8 for p in res["points"]] == [True, True]
    for p in res["points"]:
        assert set(p["strategies"]) == {"ar", "knn", "knapspec"}
        ks = p["strategies"]["knapspec"]["skip_sets"]
        assert ks and {"attn", "mlp", "context_len"} <= set(ks[0])
    assert [s["context_len"] for s in res["knapspec_sweep"]] == [64, 256, 900]
    for row in res["fixed_saving_sweep"]:
        for share in ("0.15", "0.30"):
            assert row[share] is None or row[share]["attn"] + row[share]["mlp"] >= 1
    assert res["findings"]
    assert scaling.write_outputs(res, tmp_path / "scaling") == tmp_path / "scaling" / "scaling.json"
    rendered = bench_figures.render(tmp_path / "scaling", png=False)
    assert (tmp_path / "scaling" / "scaling.html").exists() and (tmp_path / "scaling" / "scaling.md").exists()
    assert "| knapspec |" in rendered["table"]


# --- transformers' model.generate as an independent reference ------------------------------------
def test_hf_generate_is_part_of_the_lossless_check(tiny, tiny_calibration, question_file, tmp_path):
    out = tmp_path / "hf"
    rc = _main(tiny, tiny_calibration, question_file, out, "--strategies", "ar,static,knn", "--limit", "1",
               "--categories", "qa,translation,summarization", "--no-figures", "--hf-generate-every", "1")
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lossless"] is True and summary["lossless_vs_ar"] is True
    assert summary["lossless_vs_hf"] is True                  # generate ran and agreed with ar on all 3
    assert summary["hf_generate_matches_ar"] == "3/3"
    assert "model.generate" in summary["definitions"]["lossless"]
    # without generate there is nothing to compare against: null, not a pass
    rc = _main(tiny, tiny_calibration, question_file, tmp_path / "nohf", "--strategies", "ar,static",
               "--limit", "1", "--categories", "qa", "--no-figures", "--hf-generate-every", "0")
    assert rc == 0
    assert json.loads((tmp_path / "nohf" / "summary.json").read_text())["lossless_vs_hf"] is None


def test_hf_generate_mismatch_fails_naming_prompt_and_strategy(tiny, tiny_calibration, question_file, tmp_path,
                                                               monkeypatch, capsys):
    real = type(tiny.hf_model).generate
    prompt_ids = {}
    for q in specbench.select(specbench.load_questions(question_file), ["qa", "translation"], 1):
        prompt_ids[q.question_id] = tiny.encode(q.prompt).ids
    target = prompt_ids[7]                                    # the first qa question

    def tampered(self, input_ids, **kw):
        out = real(self, input_ids, **kw)
        if tuple(input_ids[0].tolist()) == target and kw.get("max_new_tokens") == 10:
            out = out.clone()
            out[0, input_ids.shape[1] + 2] = (out[0, input_ids.shape[1] + 2] + 1) % tiny.vocab
        return out

    monkeypatch.setattr(type(tiny.hf_model), "generate", tampered)
    out = tmp_path / "hf_broken"
    rc = _main(tiny, tiny_calibration, question_file, out, "--strategies", "ar,static", "--limit", "1",
               "--categories", "qa,translation", "--no-figures", "--hf-generate-every", "1")
    assert rc == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lossless"] is False
    assert summary["lossless_vs_ar"] is True and summary["lossless_vs_hf"] is False
    assert summary["hf_generate_matches_ar"] == "1/2"
    (f,) = summary["lossless_failures"]
    assert (f["question_id"], f["category"], f["strategy"], f["reference"]) == (7, "qa", "ar", "hf_generate")
    assert f["first_difference_at_token"] == 2
    err = capsys.readouterr().err
    assert "LOSSLESS FAILURE: strategy ar on question 7 (qa) differs from transformers' " \
           "model.generate at token 2" in err


def test_hf_reference_stops_where_the_core_stops(tiny):
    # the stop set handed to generate is the core's, and the comparison cuts after the first EOS
    kw = reference.hf_greedy_kwargs(tiny, 12)
    assert kw["eos_token_id"] == sorted(tiny.eos_ids) and kw["do_sample"] is False
    assert kw["repetition_penalty"] == 1.0 and kw["max_new_tokens"] == 12
    eos = next(iter(tiny.eos_ids))
    assert reference.cut_at_eos([5, 6, eos, eos, eos], tiny.eos_ids) == (5, 6, eos)
    assert reference.cut_at_eos([5, 6], tiny.eos_ids) == (5, 6)


def test_draft_kind_and_lookup_are_settings_of_the_run(tiny, tiny_calibration, question_file, tmp_path):
    runs = {}
    for name, extra in {"int8": (), "fp32": ("--draft", "fp32", "--no-lookup", "--fixed-gamma")}.items():
        assert _main(tiny, tiny_calibration, question_file, tmp_path / name, "--strategies", "ar,static",
                     "--hf-generate-every", "0", *extra) == 0
        runs[name] = json.loads((tmp_path / name / "summary.json").read_text())
    a, b = runs["int8"]["settings"], runs["fp32"]["settings"]
    assert (a["draft"], a["lookup"], a["adaptive_gamma"]) == ("int8", True, True)
    assert (b["draft"], b["lookup"], b["adaptive_gamma"]) == ("fp32", False, False)
    assert runs["fp32"]["strategies"]["static"]["lookup_steps"] == 0
    for run in runs.values():
        assert run["lossless"] is True
        assert run["strategies"]["static"]["predicted_speedup_measured_alpha"] > 0


def test_traces_option_writes_a_replayable_trace_per_run(tiny, tiny_calibration, question_file, tmp_path):
    from ssd_core.engine.trace import Trace
    out, traces = tmp_path / "run", tmp_path / "traces"
    assert _main(tiny, tiny_calibration, question_file, out, "--strategies", "ar,knn,knapspec", "--limit", "1",
                 "--traces", str(traces)) == 0
    for name in ("ar", "knn", "knapspec"):
        answers = [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        assert sorted(p.name for p in (traces / name).iterdir()) == sorted(f"{a['question_id']}.json"
                                                                         for a in answers)
        for a in answers:
            trace = Trace.load(traces / name / f"{a['question_id']}.json")
            assert trace.strategy == name and trace.meta["question_id"] == a["question_id"]
            choice = a["choices"][0]
            assert trace.text == choice["turns"][0] and trace.stats.new_tokens == choice["new_tokens"][0]
            assert list(trace.stats.accept_lengths) == choice["accept_lengths"][0]


def _answers(path, lengths: dict) -> None:
    with open(path, "w") as f:
        for qid, steps in lengths.items():
            f.write(json.dumps({"question_id": qid, "category": "math",
                                "choices": [{"index": 0, "accept_lengths": [steps]}]}) + "\n")


def test_tau_ratio_pools_like_the_bench_and_bootstraps_over_prompts(tmp_path, capsys):
    _answers(tmp_path / "knn.jsonl", {1: [2, 2], 2: [3, 1], 3: [5]})
    _answers(tmp_path / "static.jsonl", {1: [1, 1], 2: [2, 2], 4: [9]})    # 3 and 4: not shared, left out
    r = tau_ratio.tau_ratio(tau_ratio.step_lengths(tmp_path / "knn.jsonl"),
                            tau_ratio.step_lengths(tmp_path / "static.jsonl"), resamples=400, goal=1.2)
    assert r["prompts"] == 2 and r["tau_a"] == 2.0 and r["tau_b"] == 1.5     # 8/4 and 6/4, pooled over steps
    assert tau_ratio.pooled_tau(tau_ratio.step_lengths(tmp_path / "knn.jsonl")) == 13 / 5   # every prompt's steps
    assert r["ratio"] == pytest.approx(4 / 3)
    lo, hi = r["ci95"]
    assert lo < r["ratio"] < hi and lo == pytest.approx(1.0) and hi == pytest.approx(2.0)  # prompt 1 or 2 alone
    assert 0 < r["share_at_or_above_goal"] < 1
    same = tau_ratio.tau_ratio({1: [2, 2], 2: [4]}, {1: [1, 1], 2: [2]}, resamples=50)
    assert same["ci95"] == pytest.approx((2.0, 2.0))       # every prompt agrees: no spread to report
    with pytest.raises(ValueError):
        tau_ratio.tau_ratio({1: [1]}, {2: [1]})
    tau_ratio.main([str(tmp_path), "--resamples", "200"])
    assert "= 1.333 over 2 prompts" in capsys.readouterr().out


def test_results_md_states_the_routing_gain_and_how_gamma_was_chosen(tmp_path):
    """The Benchmark tab's results.md gives τ(knn) / τ(static) with its interval (the same numbers as
    python -m ssd_core.tools.tau_ratio) and τ(knn) / τ(oracle), and says whether γ was fixed."""
    _answers(tmp_path / "knn.jsonl", {1: [2, 2], 2: [3, 1]})
    _answers(tmp_path / "static.jsonl", {1: [1, 1], 2: [2, 2]})
    _answers(tmp_path / "oracle.jsonl", {1: [2, 2], 2: [2, 2]})
    answers = {n: specbench.load_answers(tmp_path / f"{n}.jsonl") for n in ("knn", "static", "oracle")}
    assert tau_ratio.step_lengths(answers["knn"]) == tau_ratio.step_lengths(tmp_path / "knn.jsonl")
    summary = {"model": "m", "order": [1, 2], "strategies": {}, "settings": {"gamma": 4, "adaptive_gamma": False}}
    md = bench_figures.markdown_report(summary, answers)
    r = tau_ratio.tau_ratio(tau_ratio.step_lengths(answers["knn"]), tau_ratio.step_lengths(answers["static"]))
    lo, hi = r["ci95"]
    assert "## KNN routing vs one static set" in md
    assert f"= 2.000 / 1.500 = **1.333** over 2 prompts (95% paired bootstrap interval [{lo:.3f}, {hi:.3f}])" in md
    assert "τ(knn) / τ(oracle) = 1.000" in md and "γ = 4 (fixed)" in md
    summary["settings"]["adaptive_gamma"] = True
    assert "γ ≤ 4 (adaptive)" in bench_figures.markdown_report(summary)
    assert "vs one static set" not in bench_figures.markdown_report(summary)              # no answers given
    assert "vs one static set" not in bench_figures.markdown_report(summary, {"knn": answers["knn"]})
    del summary["settings"]["adaptive_gamma"]                                             # older runs
    assert "γ: 4" in bench_figures.markdown_report(summary)


# --- --batch N: concurrent streams through the serving engine, timed like llama-batched-bench ------------
def _batch(tiny, tmp_path, capsys, *extra):
    out = tmp_path / "batch.json"
    rc = bench.main(["--batch", *extra, "--prompt-tokens", "24", "--gen-tokens", "6", "--no-progress",
                     "--out", str(out)], backbone=tiny)
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    return rc, lines, json.loads(out.read_text())


def test_batch_times_n_streams_released_together(tiny, tmp_path, capsys):
    """Plain batched decoding (no calibration needed): every stream gets exactly --gen-tokens after its
    Start, all Starts come from one shared prefill, sizes and repeats interleave, repeats match ar."""
    from ssd_core.tools.batch_bench import fit_prompt
    rc, lines, report = _batch(tiny, tmp_path, capsys, "1,3", "--strategies", "ar", "--repeats", "2")
    assert rc == 0
    assert [(r["repeat"], r["sequences"]) for r in lines] == [(0, 1), (0, 3), (1, 3), (1, 1)]
    for r in lines:
        for key in ("sequences", "prompt_tokens", "gen_tokens", "gen_tokens_per_s", "prefill_s", "total_s",
                    "threads", "strategy", "gamma_choices", "cpu"):
            assert key in r, key
        # ar: one token a step; 6 decode steps after one engine step that prefilled every prompt
        assert r["tokens_counted"] == r["sequences"] * 6 and r["decode_steps"] == 6
        assert r["gen_tokens_per_s"] == pytest.approx(r["tokens_counted"] / r["gen_s"], rel=0.01)
        assert r["total_s"] == pytest.approx(r["prefill_s"] + r["gen_s"], abs=1e-3)
        assert r["drafted_lengths"] == {"0": r["tokens_counted"]} and r["mean_rows_per_step"] == r["sequences"]
    assert [r["matches_ar"] for r in lines] == [None, None, True, True]
    assert [r["sequences"] for r in report["runs"]] == [1, 3, 3, 1]
    three = report["runs"][1]["streams"]
    assert [s["domain"] for s in three] == ["summarization", "math", "translation"]
    assert {"cpu", "kernel"} <= set(report["machine"]) and "--batch 1,3" in report["command"]
    assert [(m["sequences"], m["repeats"]) for m in report["medians"]] == [(1, 2), (3, 2)]
    for text in ("Hi", "x" * 100):                                   # repeated or cut inside the chat template
        fitted, whole = fit_prompt(tiny, text, 24), tiny.encode(text)
        assert len(fitted) == 24 and fitted.ids[-1] == whole.ids[-1] and fitted.ids[0] == whole.ids[0]


def test_batch_knn_with_the_goodput_rule_matches_ar(tiny, tiny_calibration, tmp_path, capsys):
    rc, lines, report = _batch(tiny, tmp_path, capsys, "3", "--strategies", "knn,ar", "--calibration",
                               str(tiny_calibration.folder), "--no-warmup")
    assert rc == 0
    ar, knn = lines                                                   # ar first: the reference
    assert (ar["strategy"], knn["strategy"]) == ("ar", "knn") and knn["matches_ar"] is True
    assert knn["tokens_counted"] == ar["tokens_counted"] == 3 * 6
    gamma = report["settings"]["gamma"]
    assert knn["gamma_choices"] and all(0 <= int(g) <= gamma for g in knn["gamma_choices"])
    assert sum(knn["gamma_choices"].values()) <= knn["decode_steps"]  # the rule is asked only when rows share
