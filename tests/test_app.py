"""The app's handlers and views, driven directly (no browser): the tiny model and its calibration.

The handlers (viz.handlers, viz.walk_handlers) return named outputs; app.py only adapts them to Gradio."""
import html
import re
import json
import shutil

import gradio as gr
import pytest

import app
from viz import adapter
from viz import api_handlers
from viz import handlers
from viz import page_handlers
from viz import race_handlers
from viz import startup
from viz import studio as vstudio
from viz import walk_handlers
from viz import session as session_views
from viz.session import Session
from ssd_core.engine.backbone import EMPTY
from ssd_core.engine.decode import Step
from ssd_core.engine.generate import generate as core_generate
from ssd_core.engine.skipset import SkipSet
from ssd_core.policies.ar import Autoregressive
from viz import benchmark as vbench
from viz import cost as vcost
from viz import layers as vlayers
from viz import stepthrough as vwalk
from viz import theme
from viz import tokens as vtok

PROMPT = "Translate German to English: Guten Morgen, wie geht es dir?"
SETTINGS = dict(domain="translation", max_new=32, gamma=3, threshold=0.0, temperature=0.0, top_p=1.0, k=5)


@pytest.fixture(scope="module")
def studio(tiny, tiny_calibration):
    return startup.load_studio(backbone=tiny, calibration=tiny_calibration.folder, warm=False)


def run(handler, studio, strategy="KNN-SSD", prompt=PROMPT, session=None, **kw):
    s = {**SETTINGS, **kw}
    return list(handler(studio, session, prompt, strategy, s["domain"], s["max_new"], s["gamma"],
                        s["threshold"], s["temperature"], s["top_p"], s["k"]))


def column(outputs, name):
    """Every value one output received (an output not named is left unchanged)."""
    assert name in handlers.GEN_OUTPUTS
    return [o[name] for o in outputs if name in o]


def a_step(**kw):
    base = dict(index=2, context_len=40, drafted=(10, 11, 12), draft_probs=(0.9, 0.8, 0.4),
                verified=(10, 11, 20, 21), accepted=2, committed=(10, 11, 20), skip=SkipSet({3}, {4}, "math"),
                draft_s=0.01, verify_s=0.02, overhead_s=0.001)
    base.update(kw)
    return Step(**base)


# --- views ---------------------------------------------------------------------------------------
def test_a_step_reads_in_the_order_it_happened():
    names = {10: " the", 11: " cat", 12: " sat", 20: " is"}
    toks = vtok.step_tokens(a_step(), names.get)
    assert [(t.text, t.kind) for t in toks] == [(" the", "accepted"), (" cat", "accepted"),
                                                (" sat", "rejected"), (" is", "verifier")]
    assert toks[0].tip.startswith("step 3") and "p = 0.90" in toks[0].tip
    assert "verifier chose “ is”" in toks[2].tip and "p = 0.40" in toks[2].tip
    assert "replaces rejected draft “ sat”" in toks[3].tip
    html = vtok.tokens_html(toks)
    assert html.count('class="tok acc"') == 2 and 'class="tok rej"' in html and 'class="tok ver"' in html


def test_full_accept_gives_a_bonus_token_and_ar_steps_are_blue():
    full = a_step(accepted=3, verified=(10, 11, 12, 30), committed=(10, 11, 12, 30))
    toks = vtok.step_tokens(full, str)
    assert [t.kind for t in toks] == ["accepted"] * 3 + ["verifier"] and "bonus" in toks[-1].tip
    ar = a_step(drafted=(), draft_probs=(), verified=(5,), accepted=0, committed=(5,), skip=None)
    assert [(t.kind, "autoregressive" in t.tip) for t in vtok.step_tokens(ar, str)] == [("verifier", True)]


def test_token_text_cannot_inject_markup_or_templates():
    html = vtok.token_html(vtok.Token("<b>{{x}} ${y}</b>", "accepted", 1, "tip"))
    assert "<b>" not in html and "{{" not in html and "${" not in html
    assert "&#123;&#123;x&#125;&#125;" in html


def test_the_three_token_kinds_meet_wcag_aa_and_differ_beyond_hue():
    for k in theme.KINDS.values():
        assert theme.contrast_ratio(k.ink, k.tint) >= 4.5, k.name
    assert (theme.ACCEPTED.key, theme.REJECTED.key, theme.VERIFIER.key) == ("#2e9d5b", "#c0392b", "#2f6db5")
    css = theme.css_variables()
    assert "line-through" in css and "underline" in css
    assert "Legend" not in vtok.legend_html() and "struck through" in vtok.legend_html()


def test_the_dark_theme_keeps_tokens_and_text_legible():
    for k in theme.DARK_KINDS.values():
        assert theme.contrast_ratio(k.ink, k.tint) >= 4.5, k.name
        assert theme.contrast_ratio(k.ink, theme.DARK_BLOCK) >= 4.5, k.name
    for name in ("ink", "muted"):
        for page in (theme.DARK_BODY, theme.DARK_BLOCK):
            assert theme.contrast_ratio(theme.DARK[name], page) >= 4.5, name
    css = theme.css_variables()
    light, dark = css.split(".dark {", 1)
    assert f"--accepted-ink: {theme.ACCEPTED.ink};" in light              # light mode unchanged
    assert f"--accepted-ink: {theme.DARK_KINDS['accepted'].ink};" in dark.split("}", 1)[0]
    assert f"--ink: {theme.DARK['ink']};" in dark.split("}", 1)[0]
    layout = theme.base_layout("t")
    assert layout["paper_bgcolor"] == layout["plot_bgcolor"] == "rgba(0,0,0,0)"   # figures take the page's colour


def test_layer_map_shows_the_set_in_use_above_every_domain_set(tiny_calibration):
    cal = tiny_calibration
    n = cal.latency.n_layers
    fig = vlayers.layer_map(n, cal.domain_sets, cal.static, in_use=cal.domain_sets["math"],
                            in_use_name="math set", in_use_domain="math")
    labels = fig.layout.yaxis.ticktext
    assert len(labels) == 2 * (1 + len(cal.domain_sets) + 1)
    assert "in use" in labels[0] and len(fig.data) == 2
    changing = [(0, SkipSet({1}, set(), "knapspec")), (32, SkipSet({2, 3}, {1}, "knapspec"))]
    fig2 = vlayers.layer_map(n, cal.domain_sets, cal.static, in_use=changing[-1][1], history=changing)
    assert any(getattr(t, "yaxis", None) == "y2" for t in fig2.data)   # the per-step strip
    assert vlayers.layer_map(n).layout.annotations                     # nothing to show, said in words


def test_layer_map_shows_a_channel_set_as_cut_mlps():
    sets = {"qa": SkipSet(set(), set(), "qa", channels="qa", keep=0.7),
            "math": SkipSet({1}, {2}, "math")}
    fig = vlayers.layer_map(4, sets, None, in_use=sets["qa"], in_use_name="qa set", in_use_domain="qa")
    labels = fig.layout.yaxis.ticktext
    assert labels[1] == "mlp 0/4 · 70% ch" and labels[3] == "mlp 0/4 · 70% ch" and labels[5] == "mlp 1/4"
    assert "keep 70% of channels" in fig.layout.title.text and "skipped" not in fig.layout.title.text
    label = "int8 draft, 70% of MLP channels (qa), the rest as their mean"     # long: a line of its own
    named = vlayers.layer_map(4, sets, None, in_use=sets["qa"], in_use_name="qa set", draft=label)
    assert [a.text for a in named.layout.annotations] == [label] and label not in named.layout.title.text
    assert "1 attn + 1 MLP skipped" in vlayers.layer_map(4, sets, None, in_use=sets["math"]).layout.title.text
    top = fig.data[0]
    assert set(top.z[0]) == {0} and set(top.z[1]) == {2}             # attn runs, every MLP cut (the tint)
    assert "70% of its channels (qa ranking)" in top.text[1][0]
    grid = vlayers.sets_grid(4, sets)
    assert "pale = MLP channels cut" in grid.layout.title.text


def test_step_through_phases_reveal_more_each_click():
    step = a_step()
    names = {10: " the", 11: " cat", 12: " sat", 20: " is", 21: " on"}
    draft = vwalk.walk_html("ctx", step, "draft", names.get)
    verify = vwalk.walk_html("ctx", step, "verify", names.get)
    accept = vwalk.walk_html("ctx", step, "accept", names.get)
    assert "verifier</th>" not in draft and "pbar" in draft and "0.40" in draft
    assert "verifier</th>" in verify and "verdict" not in verify
    assert 'class="rej"' in accept and "✗" in accept and accept.count('class="match"') == 2
    with pytest.raises(ValueError):
        vwalk.walk_html("ctx", step, "later", names.get)


def test_benchmark_view_without_and_with_results(tmp_path):
    assert "No benchmark committed yet" in vbench.summary_html(None)
    (tmp_path / "run").mkdir()
    summary = {"model": "m", "lossless": True, "strategies": {
        "ar": {"tokens_per_s": 20.0, "speedup": 1.0, "tau": 1.0, "alpha": 0.0},
        "knn": {"tokens_per_s": 18.0, "speedup": 0.9, "tau": 2.1, "alpha": 0.5,
                "per_category": {"math": {"speedup": 0.8}}}}, "routing": {"math": {"math": 3}}}
    (tmp_path / "run" / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "core.json").write_text(json.dumps({"model": "m", "tokens_per_s": {"core_ar": 25.0}}))
    (tmp_path / "run" / "results.md").write_text("| a |\n|---|\n| 1 |\n")
    answer = {"question_id": 1, "category": "math", "choices": [{"index": 0, "turns": ["x"], "new_tokens": [3],
                                                                 "wall_time": [0.1], "accept_lengths": [[2, 1]],
                                                                 "decoding_steps": [2]}]}
    (tmp_path / "run" / "knn.jsonl").write_text(json.dumps(answer) + "\n")
    (tmp_path / "run" / "notes.jsonl").write_text('{"not": "an answer"}\n')
    bench = vbench.read_bench(tmp_path)
    html = vbench.summary_html(bench["summary"]) + vbench.core_html(bench["core"])
    assert "KNN-SSD" in html and "0.90×" in html and "✓" in html and "25.0" in html
    assert bench["markdown"][0][1].startswith("| a |") and list(bench["answers"]) == ["knn"]
    assert all(hasattr(f, "to_json") for f in vbench.bench_plots(bench))
    empty = vbench.read_bench(tmp_path / "nothing")
    assert empty["summary"] is None and empty["core"] is None and not empty["markdown"]
    assert vbench.bench_plots(empty) == []


# --- handlers ------------------------------------------------------------------------------------------
def test_a_one_token_run_still_draws_both_figures(studio):
    outs = run(handlers.generate, studio, "KNN-SSD", max_new=1)      # ends at the prefill's token
    assert len(column(outs, "domain_plot")) == 1 and len(column(outs, "layer_plot")) == 1
    assert "done" in column(outs, "tokens")[-1]


def test_generate_streams_tokens_and_sends_each_figure_only_when_it_changes(studio, tiny, monkeypatch):
    monkeypatch.setattr(handlers, "UPDATE_EVERY_S", 0.0)      # every step's update (the app: ≤ 5 a second)
    outs = run(handlers.generate, studio, "KNN-SSD")
    tokens = column(outs, "tokens")
    assert 'class="tok ver"' in tokens[0]            # the prefill's token is the first thing shown
    assert len(tokens) >= 4
    assert len(column(outs, "domain_plot")) == 1 and len(column(outs, "layer_plot")) == 1
    # the first token goes out alone: drawing the figures must not hold back its paint in the browser
    first = next(o for o in outs if "tokens" in o)
    assert "domain_plot" not in first and "layer_plot" not in first
    assert len(column(outs, "cost")) == 1 and len(column(outs, "what_if")) == 1
    session = outs[-1]["session"]
    route = session.run.route
    assert session.run.route_used and route["neighbours"] and "routed to" in column(outs, "route")[0]
    why = column(outs, "route")[0].split("why this domain", 1)[1]      # the K neighbours, explained
    assert why.count("<li ") == len(route["neighbours"])
    first = route["neighbours"][0]
    assert f'{first["similarity"]:.2f}' in why and first["domain"] in why
    ar = core_generate(tiny, PROMPT, Autoregressive(), max_new_tokens=32)
    assert session.run.token_ids == ar.token_ids        # what was streamed is what AR writes
    assert "done" in tokens[-1]


def test_every_strategy_runs_from_the_ui(studio):
    for label in vstudio.STRATEGY_OF_LABEL:
        outs = run(handlers.generate, studio, label)
        r = outs[-1]["session"].run
        assert r.strategy == vstudio.STRATEGY_OF_LABEL[label] and r.stats.new_tokens > 0
        if label == "autoregressive":
            assert r.skip is None and all(not s.drafted for s in r.steps)
        else:
            assert r.skip is not None and any(s.drafted for s in r.steps)


def test_knapspec_resends_the_layer_map_when_its_set_changes(studio):
    outs = run(handlers.generate, studio, "KnapSpec", max_new=96)
    r = outs[-1]["session"].run
    # the map drawn with the first step (already showing a set chosen there), then one per later change
    first_step_changed = r.history[0][0] == 1
    assert len(column(outs, "layer_plot")) == len(r.history) + (0 if first_step_changed else 1)
    assert r.history[0][1].name == "knapspec"


def test_race_measures_both_and_checks_losslessness(studio):
    outs = run(race_handlers.race, studio, "static set")
    race = outs[-1]["session"].race
    assert race.identical is True and race.tokens == race.ar_tokens
    assert race.speedup == pytest.approx(race.tokens_per_s / race.ar_tokens_per_s)
    assert "✓ identical" in column(outs, "race")[-1]
    assert f"{race.speedup:.2f}×" in column(outs, "stats")[-1]
    assert "measured" in column(outs, "cost")[-1]
    sampled = run(race_handlers.race, studio, "static set", temperature=0.8)[-1]["session"].race
    assert sampled.identical is None                    # sampling: lossless is about distributions


def test_race_vs_static_measures_the_routed_draft_against_the_static_one(studio):
    """Race vs static: KNN-SSD's routed draft, then the static draft on the same prompt: both τ, both sets,
    and the sentence that says when routing changed nothing."""
    outs = run(race_handlers.race_static, studio, "static set")        # static vs static makes no race: KNN runs
    race = outs[-1]["session"].race
    cal = studio.calibration
    assert outs[-1]["session"].run.strategy == "knn"
    assert race.against == "static draft" and race.identical is True and race.tokens == race.ar_tokens
    assert race.tau == pytest.approx(outs[-1]["session"].run.stats.tau) and race.against_tau > 0
    assert race.sets[1] == cal.static.words()
    panel = html.unescape(column(outs, "race")[-1])           # "Routing's" is escaped in the HTML
    assert "static draft" in panel and f"τ {race.against_tau:.2f}" in panel and "✓ identical" in panel
    routed = outs[-1]["session"].run.skip
    assert race.same_draft == routed.same_draft(cal.static)
    assert ("Same draft as static" in panel) == race.same_draft
    assert ("Routing's own gain" in panel) != race.same_draft
    route = column(outs, "route")[-1]
    assert ("same draft as static" in route) == race.same_draft
    stats = column(outs, "stats")[-1]
    assert "vs static" in stats and "vs AR" not in stats


def test_same_draft_and_the_route_line(tiny_calibration):
    from ssd_core.engine.skipset import SkipSet
    from viz.domain_map import route_html
    a = SkipSet(frozenset({1}), frozenset({2}), "qa")
    assert a.same_draft(a.with_name("static")) and not a.same_draft(None)
    assert not a.same_draft(SkipSet(frozenset({1}), frozenset({3}), "static"))
    assert not a.same_draft(SkipSet(frozenset({1}), frozenset({2}), "static", channels="static", keep=0.5))
    assert a.words() == "skips attention 1 · MLP 2"
    route = {"domain": "qa", "similarity": 0.8, "neighbours": [{"domain": "qa", "similarity": 0.8, "text": "x"}],
             "votes": {"qa": 1.0}}
    assert "same draft as static" in route_html(route, same_as_static=True)
    assert "same draft as static" not in route_html(route)


@pytest.fixture(scope="module")
def two_calibrations(tiny, tiny_calibration, tmp_path_factory):
    """A studio serving the tiny calibration with two more beside it under their own root: "tiny-own",
    whose domains each draft with a set of their own, and "tiny-other-embedding" (routed on the
    user-token mean, which the backbone no longer computes: it does not load, so it is not offered)."""
    root = tmp_path_factory.mktemp("calibrations")
    for name in ("tiny-own", "tiny-other-embedding"):
        shutil.copytree(tiny_calibration.folder, root / name)
    doc_path = root / "tiny-own" / "calibration.json"
    doc = json.loads(doc_path.read_text())
    for i, d in enumerate(doc["domain_sets"]):
        doc["domain_sets"][d] = SkipSet({i % 4}, {(i + 1) % 4}, d).to_dict()
    doc_path.write_text(json.dumps(doc))
    other = root / "tiny-other-embedding" / "calibration.json"
    doc = json.loads(other.read_text())
    doc["meta"]["embedding"] = "user_mean"
    other.write_text(json.dumps(doc))
    st = startup.load_studio(backbone=tiny, calibration=tiny_calibration.folder, warm=False)
    startup.load_choices(st, root=root)
    return st


def test_the_calibration_chooser_is_each_visitors_own(two_calibrations, tiny):
    """A visitor who picks another calibration routes and drafts with it; a visitor who did not keeps the
    served one; both draft from the one backbone's draft weights, built once."""
    st = two_calibrations
    served = st.calibration
    assert list(st.choices) == [st.cal_folder.name, "tiny-own"]        # the other embedding is not offered
    own = st.choices["tiny-own"]
    assert "7 of 7 domains draft with a set of their own" in own.line and "KNN-SSD layer sets" in own.title
    if all(s.same_draft(served.static) for s in served.domain_sets.values()):
        assert "routing changes nothing" in st.choices[st.cal_folder.name].line
    picked = page_handlers.choose_calibration(st, None, "tiny-own")
    session = picked["session"]
    assert session.calibration == "tiny-own" and "tiny-own" in picked["cal_info"]
    assert set(picked) == set(page_handlers.CHOOSE_OUTPUTS)
    mine = run(handlers.generate, st, "oracle", session=session, domain="math")[-1]["session"].run
    theirs = run(handlers.generate, st, "oracle", domain="math")[-1]["session"].run
    assert mine.start.skip.same_draft(own.calibration.domain_sets["math"])
    assert theirs.start.skip.same_draft(served.domain_sets["math"])
    assert not own.calibration.domain_sets["math"].same_draft(served.domain_sets["math"])
    assert st.calibration is served                     # nothing changed for anyone else
    trace = json.loads(__import__("base64").b64decode(
        handlers.trace_download(st.for_visitor("tiny-own"), session).split("base64,")[1].split('"')[0]))
    assert trace["meta"]["calibration"] == "tiny-own"
    int8 = [label for label in tiny.drafts.memory() if label.startswith("int8")]
    assert len(int8) == 1                                # one int8 draft serves both calibrations
    back = page_handlers.choose_calibration(st, session, st.cal_folder.name)
    assert back["session"].calibration is None
    assert page_handlers.choose_calibration(st, session, "no-such")["session"].calibration is None
    api = api_handlers.generate_text(st, PROMPT, "oracle", 8, calibration="tiny-own")
    assert api["calibration"] == "tiny-own" and "error" not in api
    assert "unknown calibration" in api_handlers.generate_text(st, PROMPT, calibration="nope")["error"]


def test_a_calibration_with_a_different_channel_ranking_of_the_same_name_is_refused(tiny):
    import torch
    from ssd_core.engine.drafts import DraftFactory
    f = DraftFactory(tiny)
    n, inter = tiny.n_layers, tiny.layers[0].wdown.shape[1]
    rank = torch.arange(inter).repeat(n, 1)
    f.install_channels({"math": rank})
    f.add_channels({"math": rank.clone(), "code": rank.flip(1)})        # the same ranking again: fine
    assert set(f.channel_ranks) == {"math", "code"}
    with pytest.raises(ValueError, match="differs"):
        f.add_channels({"math": rank.flip(1)})
    assert set(f.channel_ranks) == {"math", "code"}


def test_stop_ends_the_decode_at_the_next_step(studio):
    gen = handlers.generate(studio, None, PROMPT, "KNN-SSD", None, 64, 3, 0.0, 0.0, 1.0, 5)
    first = next(gen)
    session = first["session"]
    tokens = handlers.stop(studio, session)["tokens"]
    assert "stopped after" in tokens and "tok" in tokens
    rest = list(gen)
    assert session.run.stats.new_tokens < 64
    assert "stopped" in column(rest, "tokens")[-1]
    assert set(handlers.stop(studio, None)) == {"session"}          # nothing running: nothing to show


def test_bad_input_becomes_a_message_not_a_traceback(studio):
    outs = run(handlers.generate, studio, "KNN-SSD", prompt="   ")
    assert len(outs) == 1 and "Type a prompt" in outs[0]["tokens"]
    outs = run(handlers.generate, studio, "KNN-SSD", top_p=0.0)
    assert "Setting not accepted" in outs[0]["tokens"] and "top_p" in outs[0]["tokens"]


def test_examples_cycle_through_held_out_prompts(studio):
    out = handlers.pick_example(studio, None, domain="math")
    first, dom = out["prompt"], out["oracle_domain"]
    second = handlers.pick_example(studio, out["session"], domain="math")["prompt"]
    assert dom == "math" and first in studio.examples["math"] and second in studio.examples["math"]
    assert (first != second) == (len(studio.examples["math"]) > 1)
    assert handlers.strategy_changed("oracle")["oracle_domain"].visible is True
    assert adapter.outputs(handlers.strategy_changed("oracle"), ["oracle_domain"])["visible"] is True


def test_try_these_fills_a_held_out_prompt_and_races_it(studio):
    picked = handlers.pick_example(studio, None, domain="translation")
    assert picked["prompt"] in studio.examples["translation"]
    outs = run(race_handlers.race, studio, "KNN-SSD", prompt=picked["prompt"], session=picked["session"])
    session = outs[-1]["session"]
    assert session is picked["session"] and session.run.prompt == picked["prompt"].strip()
    assert session.race.identical is True and "✓ identical" in column(outs, "race")[-1]
    # the layout chains each "Try these" button: fill the prompt, then the race with Race's inputs and outputs
    demo = app.build(studio)
    deps = demo.config["dependencies"]
    comps = {c["id"]: c for c in demo.config["components"]}
    race_btn = next(i for i, c in comps.items() if c.get("props", {}).get("elem_id") == "race-btn")
    race_dep = next(d for d in deps if d["targets"] == [(race_btn, "click")])
    tries = [d for d in deps if any(t[0] in comps and "ex" in (comps[t[0]]["props"].get("elem_classes") or [])
                                    for t in d["targets"])]
    assert len(tries) == len(studio.examples)
    for fill in tries:
        chained = [d for d in deps if d.get("trigger_after") == fill["id"]]
        assert len(chained) == 1 and "prompt" in {comps[i]["props"].get("elem_id") for i in fill["outputs"]}
        assert chained[0]["inputs"] == race_dep["inputs"] and chained[0]["outputs"] == race_dep["outputs"]
        assert demo.fns[chained[0]["id"]].concurrency_id == demo.fns[race_dep["id"]].concurrency_id == "model"


def test_map_toggle_redraws_the_last_run_whole_or_zoomed_without_the_model(studio, monkeypatch):
    outs = run(handlers.generate, studio, "KNN-SSD")
    session = outs[-1]["session"]
    zoomed = column(outs, "domain_plot")[-1]
    coords = studio.domain_map.coords
    monkeypatch.setattr(handlers, "decode", lambda *a, **k: pytest.fail("the toggle ran the model"))
    out = handlers.map_zoom(studio, session, "whole map")
    whole = out["domain_plot"]
    assert out["session"] is session and session.map_whole

    def width(fig):
        return fig.layout.xaxis.range[1] - fig.layout.xaxis.range[0]
    x0, x1 = whole.layout.xaxis.range
    assert all(x0 <= x <= x1 for x in coords[:, 0]) and width(zoomed) < width(whole)
    again = handlers.map_zoom(studio, session, "neighbourhood")["domain_plot"]
    assert tuple(again.layout.xaxis.range) == tuple(zoomed.layout.xaxis.range) and not session.map_whole
    for n in session.run.route["neighbours"]:
        x, y = coords[n["index"]]
        assert again.layout.xaxis.range[0] <= x <= again.layout.xaxis.range[1]
        assert again.layout.yaxis.range[0] <= y <= again.layout.yaxis.range[1]
    labels = {a.text for a in whole.layout.annotations}
    assert labels == {f"<b>{d}</b>" for d in set(studio.calibration.router.domains)}
    assert handlers.map_zoom(studio, None, "whole map")["domain_plot"] is not None     # before any run
    monkeypatch.undo()
    handlers.map_zoom(studio, session, "whole map")
    after = column(run(handlers.generate, studio, "KNN-SSD", session=session), "domain_plot")[-1]
    assert tuple(after.layout.xaxis.range) == tuple(whole.layout.xaxis.range)   # the choice holds for the next run


def test_step_through_walks_draft_verify_accept_next(studio):
    out = walk_handlers.walk_start(studio, None, PROMPT, "KNN-SSD", None, 3, 5)
    s = out["session"]
    assert "phase: <b>draft</b>" in out["walk"] and s.walk.step is not None
    assert "verifier</th>" in walk_handlers.walk_phase(studio, s, phase="verify")["walk"]
    assert "verdict" in walk_handlers.walk_phase(studio, s, phase="accept")["walk"]
    index = s.walk.step.index
    html = walk_handlers.walk_next(studio, s)["walk"]
    assert s.walk.step.index == index + 1 and "phase: <b>draft</b>" in html
    frames = list(walk_handlers.walk_auto(studio, s, steps=2, pause=0))
    assert [f["walk"].split("phase: <b>")[1][:6] for f in frames[:3]] == ["draft<", "verify", "accept"]


def test_sessions_do_not_share_state(studio):
    a = run(handlers.generate, studio, "KNN-SSD")[-1]["session"]
    handlers.stop(studio, a)                                  # a's Stop must not reach b
    b = run(handlers.generate, studio, "static set", prompt="Write a SQL query that counts rows.")[-1]["session"]
    assert a.run.prompt == PROMPT and a.run.strategy == "knn" and b.run.strategy == "static"
    assert not b.stop and "done ·" in column(run(handlers.generate, studio, "static set", session=b), "tokens")[-1]


def test_cost_panel_explains_the_last_run(studio):
    outs = run(handlers.generate, studio, "KNN-SSD")
    html = column(outs, "cost")[-1]
    for words in ("draft cost c", "verify cost v", "expected tokens per step", "textbook prediction",
                  "predicted for this run", "Race vs AR"):
        assert words in html
    fig = handlers.what_if(studio, outs[-1]["session"], 6, 1.1)["what_if"]
    assert "γ = 6" in fig.layout.title.text and any(t.type == "contour" for t in fig.data)


def test_app_without_calibration_runs_autoregressive_and_offers_one(tiny, tiny_calibration, tmp_path,
                                                                    monkeypatch):
    bare = startup.load_studio(backbone=tiny, calibration=tmp_path / "none", warm=False)
    assert bare.calibration is None and "python -m ssd_core.calibrate" in bare.cal_error
    outs = run(handlers.generate, bare, "KNN-SSD")
    assert outs[-1]["session"].run.strategy == "ar" and "No calibration" in column(outs, "stats")[0]
    demo = app.build(bare)              # a private server (loopback, no SPACE_ID) with no calibration
    calibrate_fn = [f for f in demo.fns.values() if getattr(f.fn, "func", None) is app.run_calibration]
    assert calibrate_fn and calibrate_fn[0].tracks_progress          # tqdm bars become a progress bar
    import ssd_core.calibration.build
    calls = []
    monkeypatch.setattr(ssd_core.calibration.build, "calibrate",
                        lambda *a, **kw: calls.append(kw) or tiny_calibration)
    assert set(page_handlers.page_load(bare, None, None)) == {"session"}            # nothing changed yet
    unchanged = adapter.outputs(page_handlers.page_load(bare, None, None), page_handlers.PAGE_OUTPUTS)
    assert all(v == gr.skip() for v in unchanged[1:])
    banner, button = app.run_calibration(bare, progress=lambda *a, **kw: None)
    assert calls and calls[0]["backbone"] is tiny and "loaded" in banner["value"]
    assert bare.calibration is tiny_calibration and button["visible"] is False
    fresh = page_handlers.page_load(bare, None, None)        # a page built before the calibration existed
    assert fresh["cal_row"].visible is False and fresh["strategy"].value == "KNN-SSD"
    assert "routing accuracy" in fresh["domains_md"] and fresh["sets_plot"].visible is True
    adapted = adapter.outputs(fresh, page_handlers.PAGE_OUTPUTS)
    assert adapted[1]["visible"] is False and adapted[3]["value"] == "KNN-SSD" and adapted[2] == gr.skip()


def test_the_layout_has_every_part(studio):
    demo = app.build(studio)
    assert isinstance(page_handlers.page_load(studio, studio.calibration, None)["session"], Session)
    ids = {c.get("props", {}).get("elem_id") for c in demo.config["components"]}
    for part in ("prompt", "strategy", "generate-btn", "race-btn", "stop-btn", "tokens", "legend", "stats",
                 "route", "domain-map", "layer-map", "walk", "cost", "what-if"):
        assert part in ids, part
    # calibrated: no calibration event at all (tests/test_space.py posts every event a public server has)
    assert not [f for f in demo.fns.values() if getattr(f.fn, "func", None) is app.run_calibration]
    labels = {c.get("props", {}).get("label") for c in demo.config["components"]}
    assert {"Generate", "Step through", "Why (not) faster?", "Domains & layer sets", "Benchmark",
            "About"} <= labels


def test_a_latency_model_from_another_cpu_is_provisional_then_measured_quietly_and_cached(tiny, tiny_calibration,
                                                                                         tmp_path, monkeypatch):
    """The app plans γ, KnapSpec and auto with costs of the machine that runs, not another's: measured
    between visitors' jobs (never beside one), cached, and read back at the next start."""
    import dataclasses
    from ssd_core.calibration import load as load_cal
    from ssd_core.engine.machine import cpu_info
    from ssd_core.calibration.profiles import Quiet
    monkeypatch.setenv("KNN_SSD_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "cal"
    shutil.copytree(tiny_calibration.folder, folder)
    cal = load_cal(folder, tiny)
    stub = _StudioStub(tiny)
    assert startup.known_latency(stub, [(cal, folder)]) == [] and not cal.latency.provisional
    elsewhere = {**cal.latency.machine, "cpu": {**cpu_info(), "model": "AMD EPYC 7B13"}}
    cal.latency = dataclasses.replace(cal.latency, machine=elsewhere)
    other = load_cal(folder, tiny)                      # a calibration served beside it, profiled elsewhere
    other.latency = dataclasses.replace(other.latency, machine=elsewhere)
    todo = startup.known_latency(stub, [(cal, folder), (other, folder)])
    assert todo == [cal, other] and cal.latency.provisional and "provisional" in cal.latency.device_words
    assert "AMD EPYC 7B13" in cal.latency.machine["provisional"]
    slices = []
    real_slice = stub.quiet.slice

    def counted():
        slices.append(1)
        return real_slice()
    monkeypatch.setattr(stub.quiet, "slice", counted)
    startup.measure_latency(stub, todo)
    assert slices and stub.timings["latency_s"] >= 0
    for c in (cal, other):
        assert c.latency.stale_for(tiny) is None and not c.latency.provisional
        assert "measured on this machine" in c.latency.device_words
    again = load_cal(folder, tiny)                      # the next start: the cache has it, nothing to measure
    again.latency = dataclasses.replace(again.latency, machine=elsewhere)
    assert startup.known_latency(_StudioStub(tiny), [(again, folder)]) == []
    assert again.latency.attn_a == cal.latency.attn_a and "earlier start" in again.latency.device_words


class _StudioStub:
    def __init__(self, backbone):
        from ssd_core.calibration.profiles import Quiet
        self.backbone, self.timings, self.quiet = backbone, {}, Quiet(idle_s=0.0)


def test_the_cost_panels_headline_is_the_latency_model_applied_to_what_the_run_did(studio, monkeypatch):
    """Not the textbook formula (every step drafting γ with the model): this run's drafts per step, its free
    lookup drafts and its contexts, costed by the latency model; provisional until this machine is measured."""
    from ssd_core.calibration import profiles
    outs = run(handlers.generate, studio, "static set", prompt="abc abc abc abc abc abc abc abc abc abc")
    r = outs[-1]["session"].run
    assert any(s.source == "lookup" for s in r.steps) and any(s.source == "model" for s in r.steps)
    lat = studio.calibration.latency
    kind = r.config.draft if lat.knows(r.config.draft) else "fp32"
    spec = plain = 0.0
    for s in r.steps:           # the same sum, written out: model drafts + one verify pass; lookup is free
        n = len(s.drafted) if s.source == "model" else 0
        spec += sum(lat.step_time(s.skip, s.context_len + i, kind) for i in range(n))
        spec += lat.step_time(EMPTY, s.context_len) * lat.verify_cost(len(s.drafted) + 1)
        plain += sum(lat.step_time(EMPTY, s.context_len + i) for i in range(len(s.committed)))
    head = re.search(r'cost-head (\w+)">.*?predicted (\d+\.\d+)×', column(outs, "cost")[-1])
    assert float(head.group(2)) == pytest.approx(plain / spec, abs=0.006)
    assert head.group(1) in ("good", "bad")
    monkeypatch.setattr(studio.calibration, "latency", profiles.provisional(lat, "measuring"))
    html, _ = session_views.cost_view(studio, r, None)
    assert "provisional" in html and 'cost-head pending' in html



def test_a_page_load_shows_the_cost_panel_as_it_is_now_not_as_the_layout_was_built(studio, monkeypatch):
    """The layout is built while this machine's latency model may still be provisional; a later page load
    must not keep saying so once it is measured."""
    from ssd_core.calibration import profiles
    lat = studio.calibration.latency
    monkeypatch.setattr(studio.calibration, "latency", profiles.provisional(lat, "measuring"))
    assert "provisional" in page_handlers.page_load(studio, studio.calibration, None)["cost"]
    monkeypatch.setattr(studio.calibration, "latency", lat)
    assert "provisional" not in page_handlers.page_load(studio, studio.calibration, None)["cost"]


# --- the shared batch (serving engine, goodput rule) ------------------------------------------------
RULE = ("16 rows shared this step: draft length 0 (plain batched decoding) — predicted 230 tokens/s for all rows "
        "vs 170 drafting (mean α 0.60, provisional costs)")


def test_the_stats_line_says_who_shared_the_last_step_and_what_the_rule_chose():
    from viz import stats as vstats
    alone = html.unescape(vstats.stats_html(None, steps=[a_step()]))
    assert "alone in the batch: the strategy's own draft length" in alone
    crowd = html.unescape(vstats.stats_html(None, steps=[a_step(), a_step(rows=16, rule=RULE)]))
    assert ("shared with 15 others · draft length 0 (plain batched decoding): predicted 230 tok/s for all vs 170 "
            "drafting") in crowd and "1 of 2 steps shared, up to 16 rows" in crowd


def test_a_request_waiting_for_room_in_the_batch_shows_its_place(studio):
    from ssd_core.engine.decode import Waiting
    g = core_generate(studio.backbone, PROMPT, Autoregressive(), max_new_tokens=4)
    real = [(s, 0.01) for s in g.steps]
    events = [(Waiting(3, "all 16 rows busy"), 5.0), (Waiting(1, "KV memory: 760 of 768 MB in use"), 5.0),
              (g.start, 9.0)] + real
    r = session_views.Run(PROMPT, "ar", vstudio.make_config(4, 3, 0.0, 0.0, 1.0))
    outs = list(handlers.show_events(studio, Session(), r, iter(events)))
    assert "waiting for room in the batch: position 3 (all 16 rows busy)" in outs[0]["tokens"]
    assert "position 1 (KV memory: 760 of 768 MB in use)" in outs[1]["tokens"]
    assert r.start is g.start and len(r.steps) == len(real)         # a Waiting is neither a step nor model time
    assert r.compute_s < 5.0 and "done" in outs[-1]["tokens"]


def test_the_batch_curve_shows_where_the_rule_stops_drafting_and_where_the_run_was(studio):
    from ssd_core.engine.goodput import GoodputRule
    from viz import batch_view as vbatch
    outs = run(handlers.generate, studio, "KNN-SSD")
    fig = column(outs, "batch_plot")[-1]
    names = [t.name for t in fig.data]
    assert "this run" in names and any("provisional" in a.text for a in fig.layout.annotations)   # built-in costs
    assert fig.layout.xaxis.range[1] == studio.limits.max_rows + 0.5
    curve = GoodputRule(studio.backbone).curve(0.7, 4, 0.9)
    assert vbatch.speculation_off_at(curve) is not None and curve[0]["speedup"] > 1.0   # alone it drafts
    crowd = vbatch.batch_figure(curve, 4, 0.7, 0.9, rows_here=12.0)
    assert any("speculation off from" in a.text for a in crowd.layout.annotations)
    assert "from 6 visitors plain batched decoding" in vbatch.batch_words(curve, 4)
    assert page_handlers.page_load(studio, studio.calibration, None)["batch_plot"].data


def test_generate_runs_through_the_serving_engine(tiny, tiny_calibration):
    st = startup.load_studio(backbone=tiny, calibration=tiny_calibration.folder, warm=False)
    engine = startup.start_engine(st)
    try:
        assert tiny.engine is engine and engine.max_rows == st.limits.max_rows
        outs = run(handlers.generate, st, "KNN-SSD")
        steps = outs[-1]["session"].run.steps
        assert steps and all(s.rows == 1 for s in steps) and engine.status()["steps"] >= len(steps)
        assert "alone in the batch" in column(outs, "stats")[-1]
    finally:
        engine.close()
    assert getattr(tiny, "engine", None) is None
