"""Channel sets: drafts that keep part of every MLP, per-domain rankings, and their calibration."""
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ssd_core import calibration as cal_io
from ssd_core.calibration.channels import (STATIC, channel_importance, channel_means, channel_sets,
                                          pooled, pooled_means, ranking)
from ssd_core.calibration.domains import DOMAINS
from ssd_core.calibration.matchness import build_match_data, matchness
from ssd_core.engine.backbone import EMPTY
from ssd_core.engine.drafts import mlp_weights
from ssd_core.engine.generate import generate
from ssd_core.engine.skipset import SkipSet
from ssd_core.policies.ar import Autoregressive
from ssd_core.policies.registry import build
from ssd_core.policies.static import Static
from hf_reference import hf_greedy
from tiny import tiny_backbone

PROMPT = "Write a SQL query that counts the orders of every customer."


@pytest.fixture(scope="module")
def ranked():
    """A tiny model of its own (channel rankings are backbone state) with a made-up ranking."""
    bb = tiny_backbone()
    inter = bb.layers[0].wdown.shape[1]
    gen = torch.Generator().manual_seed(1)
    bb.drafts.install_channels({"a": torch.stack([torch.randperm(inter, generator=gen) for _ in bb.layers]),
                          STATIC: torch.arange(inter).repeat(bb.n_layers, 1)})
    return bb


@pytest.fixture(scope="module")
def compensated():
    """A made-up ranking with the mean activations of a short text: its cut drafts add a bias."""
    bb = tiny_backbone()
    inter = bb.layers[0].wdown.shape[1]
    gen = torch.Generator().manual_seed(2)
    data = build_match_data(bb, ["Write a query that lists the orders."], continuation_tokens=8,
                            max_prompt_tokens=48, progress=False)
    bb.drafts.install_channels({"a": torch.stack([torch.randperm(inter, generator=gen) for _ in bb.layers])},
                         {"a": channel_means(bb, data)})
    return bb


def test_a_channel_set_round_trips_and_checks_itself():
    s = SkipSet(frozenset({1}), frozenset(), "sql", channels="sql", keep=0.6)
    assert SkipSet.from_dict(s.to_dict()) == s and s.channel_key == ("sql", 0.6)
    assert SkipSet.from_dict({"name": "x", "attn": [1], "mlp": []}).channel_key is None   # old files load
    assert "60% of MLP channels" in str(s) and not s.is_empty
    with pytest.raises(ValueError, match="needs `channels`"):
        SkipSet(keep=0.5)
    with pytest.raises(ValueError, match="keep"):
        SkipSet(channels="sql", keep=0.0)
    # the share of weights it does not read: 40% of every MLP it runs
    assert s.weight_ratio(10, 30, 4) == pytest.approx((10 + 0.4 * 4 * 30) / 160)


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_a_channel_draft_is_the_mlp_without_the_dropped_neurons(ranked, kind):
    """The cut weights compute exactly what the full MLP computes with the dropped neurons zeroed."""
    bb = ranked
    skip = SkipSet(name="a", channels="a", keep=0.5)
    draft = bb.drafts.get(kind, small_head=False, skip=skip)
    assert draft is bb.drafts.get(kind, small_head=False, skip=skip)          # built once
    assert draft is not bb.drafts.get(kind, small_head=False)
    assert "50% of MLP channels (a)" in draft.label
    kept = bb.drafts.kept_channels("a", 0.5)
    n = bb.layers[0].wdown.shape[1]
    assert all(len(k) == n // 2 and torch.equal(k, k.sort().values) for k in kept)
    ids = bb.encode(PROMPT).ids
    out = bb.forward(ids, bb.new_cache(len(ids)), EMPTY, logits="all", draft=draft)
    base = bb.drafts.get(kind, small_head=False)
    layers = []
    for L, D, k in zip(bb.layers, base.layers if base is not None else bb.layers, kept):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[k] = True
        wgu = L.wgu * torch.cat([mask, mask]).float()[:, None]           # dropped neurons: gate = up = 0
        layers.append(types.SimpleNamespace(ln1=L.ln1, ln2=L.ln2, wqkv=L.wqkv, bqkv=L.bqkv, wo=L.wo, wgu=wgu,
                                            wdown=L.wdown, bdown=None))
    zeroed = types.SimpleNamespace(layers=layers, linear=F.linear, head=lambda h: F.linear(h, bb.lm_head))
    ref = bb.forward(ids, bb.new_cache(len(ids)), EMPTY, logits="all", draft=zeroed)
    full = bb.forward(ids, bb.new_cache(len(ids)), EMPTY, logits="all")
    if kind == "fp32":
        assert torch.allclose(out, ref, atol=1e-4)
    else:                                  # int8 rounding on top: nearer the zeroed model than the full one
        assert (out - ref).abs().mean() < (out - full).abs().mean()
    assert not torch.allclose(out, full, atol=1e-3)


@pytest.mark.parametrize("kind", ["fp32", "int8"])
@pytest.mark.parametrize("keep", [0.2, 0.7])
@pytest.mark.parametrize("which", ["ranked", "compensated"])
def test_speculation_with_a_channel_set_is_lossless(request, which, kind, keep):
    bb = request.getfixturevalue(which)
    skip = SkipSet(frozenset({2}), frozenset({1}), "a", channels="a", keep=keep)
    cfg = dict(max_new_tokens=24, gamma=3, draft=kind, lookup=False)
    ar = generate(bb, PROMPT, Autoregressive(), **cfg).token_ids
    spec = generate(bb, PROMPT, Static(skip), **cfg)
    assert spec.token_ids == ar == hf_greedy(bb, bb.encode(PROMPT), 24)[:len(ar)]
    assert sum(s.accepted for s in spec.steps) > 0 and f"{keep:.0%} of MLP channels" in spec.start.draft
    assert ("the rest as their mean" in spec.start.draft) == (which == "compensated")


def test_an_unknown_ranking_is_a_clear_error(ranked):
    with pytest.raises(ValueError, match="no MLP channel ranking 'nope'"):
        generate(ranked, PROMPT, Static(SkipSet(name="x", channels="nope", keep=0.5)), max_new_tokens=4)


def test_the_ranking_puts_the_channels_that_matter_first():
    """Keeping the top half by importance drafts better than keeping the bottom half (it can fail)."""
    bb = tiny_backbone()
    data = build_match_data(bb, [PROMPT, "Summarise: the council voted to close the old bridge."],
                            continuation_tokens=12, max_prompt_tokens=48, progress=False)
    imp = channel_importance(bb, data)
    assert imp.shape == (bb.n_layers, bb.layers[0].wdown.shape[1]) and bool((imp >= 0).all())
    r = ranking(imp)
    bb.drafts.install_channels({"top": r, "bottom": r.flip(1)})
    top = matchness(bb, SkipSet(channels="top", keep=0.5), data)
    bottom = matchness(bb, SkipSet(channels="bottom", keep=0.5), data)
    assert top > bottom


def test_continuation_importance_leaves_the_prompt_out():
    """Importance averages over the rows from the prompt's last token on: with a one-token
    continuation, the last two rows alone."""
    bb = tiny_backbone()
    data = build_match_data(bb, [PROMPT], continuation_tokens=1, max_prompt_tokens=48, progress=False)
    seq, start = data.sequences[0], data.starts[0]
    collect: list = []
    bb.forward(seq, bb.new_cache(len(seq)), SkipSet.empty(), logits="none", collect=collect)
    want = torch.zeros(bb.n_layers, bb.layers[0].wdown.shape[1])
    for i, kind, h, _ in collect:
        if kind == "mlp":
            L = bb.layers[i]
            gate, up = F.linear(F.rms_norm(
                h[start - 1:], (bb.hidden,), L.ln2, bb.eps), L.wgu).chunk(2, -1)
            want[i] = (F.silu(gate) * up).abs().mean(0) * L.wdown.norm(dim=0)
    assert torch.allclose(channel_importance(bb, data), want, rtol=1e-4, atol=1e-7)
    every_row = torch.stack([(F.silu(g) * u).abs().mean(0) * bb.layers[i].wdown.norm(dim=0) for i, (g, u) in
                             enumerate(F.linear(F.rms_norm(h, (bb.hidden,), bb.layers[i].ln2, bb.eps),
                                                bb.layers[i].wgu).chunk(2, -1)
                                       for i, kind, h, _ in collect if kind == "mlp")])
    assert not torch.allclose(every_row, want, rtol=1e-4, atol=1e-7)   # the prompt's rows would change it


def test_the_pooled_ranking_weighs_every_domain_alike():
    a = torch.tensor([[1.0, 0.0, 0.0]])
    b = torch.tensor([[0.0, 100.0, 0.0]])            # a far larger scale must not drown `a`
    assert torch.allclose(pooled({"a": a, "b": b}), torch.tensor([[1.0, 1.0, 0.0]]))


@pytest.mark.slow
def test_channel_calibration_end_to_end(tmp_path):
    from ssd_core.calibration.build import CalibrationSettings, calibrate
    bb = tiny_backbone()
    settings = CalibrationSettings(gamma=3, prompts_per_domain=4, held_out_per_domain=3, continuation_tokens=8,
                                   max_prompt_tokens=48, umap=False, search_mode="channels", channel_keep=0.6)
    cal = calibrate(None, tmp_path / "ch", settings, backbone=bb, progress=False,
                    profile_kw={"contexts": (16, 64), "verify_ks": (1, 2, 4), "repeats": 2})
    assert cal.static == SkipSet(name=STATIC, channels=STATIC, keep=0.6)
    assert cal.meta["settings"]["channel_keep"] == 0.6 and cal.meta["search"] == {}
    assert cal.meta["settings"]["channel_compensation"] == "mean"        # the settled choice, as a label
    assert (tmp_path / "ch" / "channel_means.npz").exists()
    for d in DOMAINS:
        s = cal.domain_sets[d]
        assert s.channels in (d, STATIC) and s.keep == 0.6 and not s.attn and not s.mlp
        assert (s.channels == d) == cal.meta["check"][d]["passed"]
    assert (tmp_path / "ch" / "channels.npz").exists()
    fresh = tiny_backbone()
    again = cal_io.load(tmp_path / "ch", fresh)
    installed = fresh.drafts
    assert set(installed.channel_ranks) == set(installed.channel_means) == set(DOMAINS) | {STATIC}
    assert all(torch.equal(installed.channel_ranks[k], bb.drafts.channel_ranks[k]) for k in installed.channel_ranks)
    assert all(torch.allclose(installed.channel_means[k], bb.drafts.channel_means[k]) for k in installed.channel_means)
    prompt = "Translate German to English: Guten Morgen."
    ar = generate(fresh, prompt, Autoregressive(), max_new_tokens=16).token_ids
    for name in ("static", "knn", "oracle"):
        g = generate(fresh, prompt, build(again, name, gamma=3, category="translation"), max_new_tokens=16, gamma=3)
        assert g.token_ids == ar, name
    with pytest.raises(ValueError, match="channel_keep must lie in"):
        calibrate(None, tmp_path / "no", settings, backbone=bb, channel_keep=0.0)
    (tmp_path / "ch" / "channels.npz").write_bytes(b"changed")
    with pytest.raises(cal_io.CalibrationError, match="checksum"):
        cal_io.load(tmp_path / "ch", tiny_backbone())


def test_a_cut_draft_shares_the_head_and_attention_of_its_base(ranked):
    base = ranked.drafts.get("int8", small_head=False)
    cut = ranked.drafts.get("int8", small_head=False, skip=SkipSet(channels="a", keep=0.5))
    assert cut.head is base.head and base.channels is None and cut.channels == ("a", 0.5)
    assert all(c.wqkv is b.wqkv and c.wo is b.wo and c.wgu is not b.wgu for c, b in zip(cut.layers, base.layers))


def _activations(bb, x, L):
    gate, up = F.linear(F.rms_norm(x, (bb.hidden,), L.ln2, bb.eps), L.wgu).chunk(2, -1)
    return F.silu(gate) * up


def test_a_compensated_cut_mlp_adds_the_dropped_channels_mean():
    """At a row whose activations are the means, the cut MLP plus its bias is the full MLP; without
    the bias it is not (the dropped channels' share is missing)."""
    bb = tiny_backbone()
    L = bb.layers[1]
    x = torch.randn(1, bb.hidden, generator=torch.Generator().manual_seed(3))
    a = _activations(bb, x, L)[0]
    kept = torch.arange(0, a.numel(), 3)
    wgu, wdown, bias = mlp_weights(L, kept, a)
    cut = types.SimpleNamespace(ln2=L.ln2, wgu=wgu, wdown=wdown, bdown=bias)
    full = bb._mlp(x, L, F.linear)
    assert torch.allclose(bb._mlp(x, cut, F.linear), full, atol=1e-5)
    assert not torch.allclose(bb._mlp(x, types.SimpleNamespace(ln2=L.ln2, wgu=wgu, wdown=wdown, bdown=None),
                                      F.linear), full, atol=1e-3)
    assert mlp_weights(L, kept)[2] is None


@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_a_compensated_draft_is_the_cut_draft_plus_the_bias(compensated, kind):
    """The whole draft: what a model with the dropped neurons zeroed and the bias added computes."""
    bb = compensated
    skip = SkipSet(name="a", channels="a", keep=0.5)
    draft = bb.drafts.get(kind, small_head=False, skip=skip)
    assert draft.compensated and "50% of MLP channels (a), the rest as their mean" in draft.label
    kept = bb.drafts.kept_channels("a", 0.5)
    n = bb.layers[0].wdown.shape[1]
    layers = []
    for i, (L, k) in enumerate(zip(bb.layers, kept)):
        mask = torch.zeros(n, dtype=torch.bool)
        mask[k] = True
        layers.append(types.SimpleNamespace(
            ln1=L.ln1, ln2=L.ln2, wqkv=L.wqkv, bqkv=L.bqkv, wo=L.wo,
            wgu=L.wgu * torch.cat([mask, mask]).float()[:, None], wdown=L.wdown,
            bdown=L.wdown[:, ~mask] @ bb.drafts.channel_means["a"][i][~mask]))
    ids = bb.encode(PROMPT).ids
    run = lambda d: bb.forward(ids, bb.new_cache(len(ids)), EMPTY, logits="all", draft=d)
    ref = run(types.SimpleNamespace(layers=layers, linear=F.linear, head=lambda h: F.linear(h, bb.lm_head)))
    for L in layers:
        L.bdown = None
    plain = run(types.SimpleNamespace(layers=layers, linear=F.linear, head=lambda h: F.linear(h, bb.lm_head)))
    out = run(draft)
    if kind == "fp32":
        assert torch.allclose(out, ref, atol=1e-4)
    assert (out - ref).abs().mean() < (out - plain).abs().mean()


def test_channel_means_are_the_continuations_mean_activation():
    """Checked against transformers' model (hooks on down_proj's input): an independent forward."""
    bb = tiny_backbone()
    data = build_match_data(bb, [PROMPT, "Translate to French: the cat sleeps."], continuation_tokens=5,
                            max_prompt_tokens=48, progress=False)
    seen: dict = {}
    hooks = [layer.mlp.down_proj.register_forward_pre_hook(lambda _m, args, i=i: seen.__setitem__(i, args[0][0]))
             for i, layer in enumerate(bb.hf_model.model.layers)]
    total, rows = 0, 0
    try:
        with torch.no_grad():
            for seq, start in zip(data.sequences, data.starts):
                bb.hf_model(input_ids=torch.tensor([seq]))
                total = total + torch.stack([seen[i][start - 1:].sum(0) for i in range(bb.n_layers)])
                rows += len(seq) - start + 1
    finally:
        for h in hooks:
            h.remove()
    means = channel_means(bb, data)
    assert torch.allclose(means, total / rows, atol=1e-5)
    assert bool((means < 0).any())                       # signed, unlike the importance
    ranks, by, _, _ = channel_sets(bb, {"sql": data, "qa": data.with_targets(data.targets)}, 0.5, progress=False)
    assert set(by) == {"sql", "qa", STATIC} and torch.allclose(by[STATIC], means)
    assert torch.allclose(pooled_means({"a": torch.zeros(2, 3), "b": torch.ones(2, 3)}), torch.full((2, 3), 0.5))


def test_means_must_fit_an_installed_ranking():
    bb = tiny_backbone()
    r = torch.arange(bb.layers[0].wdown.shape[1]).repeat(bb.n_layers, 1)
    with pytest.raises(ValueError, match="not installed"):
        bb.drafts.install_channels({"a": r}, {"b": torch.zeros(r.shape)})
    with pytest.raises(ValueError, match="mean activations 'a' has shape"):
        bb.drafts.install_channels({"a": r}, {"a": torch.zeros(2, 3)})
    bb.drafts.install_channels({"a": r}, {"a": torch.zeros(r.shape)})
    assert bb.drafts.get("fp32", False, SkipSet(channels="a", keep=0.5)).compensated
    bb.drafts.install_channels({"a": r})                       # re-installed without: the cut drafts are rebuilt
    assert not bb.drafts.get("fp32", False, SkipSet(channels="a", keep=0.5)).compensated


COMMITTED = Path(__file__).resolve().parents[1] / "assets" / "calibration"


@pytest.mark.parametrize("folder", sorted(p.name for p in COMMITTED.iterdir() if p.is_dir()))
def test_the_committed_artefacts_load(folder):
    """Every committed artefact passes its checksums against today's domain prompts (a prompt file edited
    without re-calibrating fails here, not in the app's banner)."""
    cal = cal_io.load(COMMITTED / folder)
    assert set(cal.domain_sets) == set(DOMAINS)


def test_the_committed_channel_artefact_is_the_one_the_readme_describes():
    """README "Rankings over the whole answer": keep 0.5, magnitude rankings over 64-token continuations,
    the dropped channels' mean, every domain set past its check; a ranking and means for every domain
    and the static set."""
    cal = cal_io.load(COMMITTED / "smollm2-135m-instruct-channels")
    s = cal.meta["settings"]
    assert (s["search_mode"], s["channel_keep"], s["continuation_tokens"], s["channel_importance"],
            s["channel_compensation"]) == ("channels", 0.5, 64, "magnitude", "mean")
    assert all(c["passed"] for c in cal.meta["check"].values()) and set(cal.meta["check"]) == set(DOMAINS)
    assert set(cal.channel_ranks) == set(cal.channel_means) == {*DOMAINS, STATIC}
    assert all(cal.domain_sets[d].channels == d for d in DOMAINS) and cal.static.channels == STATIC
