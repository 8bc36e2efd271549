"""The verifier's matmul kernel: oneDNN-prepacked fp32 weights vs F.linear on the weights as loaded.

Prepacking changes only the summation order of the same fp32 arithmetic; these tests hold both kernels
to each other and to transformers' `generate`, for autoregressive and speculative decoding.
"""
import json

import pytest
import torch

from hf_reference import hf_greedy
from ssd_core.engine import backbone as backbone_module, drafts as drafts_module, machine
from ssd_core.engine.draft import DRAFT_MATRICES, DraftWeights
from ssd_core.engine.drafts import DraftFactory
from ssd_core.engine.weights import onednn_available, split_linear, split_pack
from ssd_core.engine.decode import DecodeConfig
from ssd_core.engine.generate import generate
from ssd_core.engine.skipset import SkipSet
from ssd_core.policies.ar import Autoregressive
from ssd_core.policies.static import Static
from tiny import tiny_backbone

needs_onednn = pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32),
                                  reason="this torch build has no oneDNN")
PROMPTS = ["Translate German to English: Guten Morgen!", "Summarize: the bridge will be repaired.", "q"]


def _logits(bb, ids):
    """Prefill, then a 5-token verify-shaped pass: every row's logits."""
    cache = bb.new_cache(256)
    first = bb.prefill(ids, cache).logits
    return torch.cat([first[None], bb.forward([5, 6, 7, 8, 9], cache, logits="all")])


@needs_onednn
def test_auto_measures_each_pass_shape_once_and_caches_the_choice_per_cpu(monkeypatch, tmp_path):
    """auto: the faster kernel for one row and for several, measured on this machine and cached outside
    the project, keyed by CPU; a second backbone reads the cache; another CPU measures again."""
    monkeypatch.delenv("SSD_KERNEL", raising=False)
    monkeypatch.setenv("KNN_SSD_CACHE", str(tmp_path))
    calls = []

    def fake(bb, rows=(1, 5), **kw):       # onednn loses one row and wins five, as on one Xeon
        calls.append(bb.name)
        return {1: {"plain": 0.030, "onednn": 0.040}, 5: {"plain": 0.090, "onednn": 0.050}}
    monkeypatch.setattr(machine, "measure_kernels", fake)
    bb = tiny_backbone()
    assert bb.kernel == "plain/onednn" and len(calls) == 1
    assert bb._targets[0][1] is torch.nn.functional.linear and bb._targets[1][1] is not torch.nn.functional.linear
    entry, = json.loads((tmp_path / machine.CHOICE_FILE).read_text()).values()
    assert entry["choice"] == ["plain", "onednn"] and entry["cpu"] == machine.cpu_info()
    assert entry["timings"]["1"] == {"plain": 30.0, "onednn": 40.0}
    assert tiny_backbone().kernel == "plain/onednn" and len(calls) == 1        # cached
    other = {**machine.cpu_info(), "model": "AMD EPYC (another machine)"}
    monkeypatch.setattr(machine, "cpu_info", lambda: other)
    tiny_backbone()
    assert len(calls) == 2                                                     # another CPU: measured
    (tmp_path / machine.CHOICE_FILE).write_text("{not json")
    assert tiny_backbone().kernel == "plain/onednn" and len(calls) == 3        # a broken cache: measured


@needs_onednn
def test_auto_may_choose_the_split_kernel_for_one_row_and_keeps_only_the_copies_it_uses(monkeypatch, tmp_path):
    """On an AMD EPYC a one-row GEMM ran on one thread: the weights cut into a slab per thread won one row."""
    monkeypatch.delenv("SSD_KERNEL", raising=False)
    monkeypatch.setenv("KNN_SSD_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "measure_kernels", lambda bb, **kw: {
        1: {"plain": 0.060, "onednn": 0.048, "split": 0.037}, 5: {"plain": 0.12, "onednn": 0.07, "split": 0.095}})
    bb = tiny_backbone()
    assert bb.kernel == "split/onednn" and set(bb._copies) == {"split", "onednn"}
    assert bb._targets[0][0][0].wqkv.dim() == 3              # (slabs, in, out / slabs)
    x = torch.randn(1, bb.hidden)
    torch.testing.assert_close(bb.head_logits(x), torch.nn.functional.linear(x, bb.lm_head), rtol=1e-5, atol=1e-5)
    bb.set_kernel("plain")
    assert bb._copies == {}


@needs_onednn
def test_plain_wins_everywhere_drops_the_packed_copy(monkeypatch, tmp_path):
    monkeypatch.delenv("SSD_KERNEL", raising=False)
    monkeypatch.setenv("KNN_SSD_CACHE", str(tmp_path))
    monkeypatch.setattr(machine, "measure_kernels",
                        lambda bb, **kw: {1: {"plain": 1.0, "onednn": 2.0}, 5: {"plain": 1.0, "onednn": 2.0}})
    bb = tiny_backbone()
    assert bb.kernel == "plain" and bb._copies == {}


def test_kernels_are_selectable_by_name_and_environment(monkeypatch):
    bb = tiny_backbone()
    for name in ("plain", "onednn", "split", "plain/onednn", "split/onednn", "onednn/plain"):
        if "onednn" in name and not onednn_available(torch.device("cpu"), torch.float32):
            continue
        bb.set_kernel(name)
        assert bb.kernel == name
    monkeypatch.setenv("SSD_KERNEL", "plain")
    assert tiny_backbone().kernel == "plain"
    for bad in ("fast", "plain/fast", "/onednn"):
        with pytest.raises(ValueError, match="auto, plain, onednn or split"):
            bb.set_kernel(bad)


def test_measure_kernels_times_both_kernels_for_each_shape():
    bb = tiny_backbone()
    timing = machine.measure_kernels(bb, rows=(1, 3), repeats=2)
    assert set(timing) == {1, 3} and all(set(t) == set(machine.KERNELS) for t in timing.values())
    assert all(s > 0 for t in timing.values() for s in t.values())


def test_measuring_packs_the_weights_once_and_puts_the_kernels_back(monkeypatch):
    """Switching kernels between timed passes must not re-pack every weight each time (that cost ~5 s
    of a cold start-up), and the backbone decodes on its own kernels afterwards."""
    bb = tiny_backbone()
    bb.set_kernel("plain")
    packs = {"onednn": 0, "split": 0}
    for kernel in packs:
        real = getattr(backbone_module, f"{kernel}_pack")
        monkeypatch.setattr(backbone_module, f"{kernel}_pack",
                            lambda *a, real=real, kernel=kernel: packs.update({kernel: packs[kernel] + 1}) or real(*a))
    machine.measure_kernels(bb, rows=(1, 3), repeats=3)
    assert packs == {k: 4 * len(bb.layers) + 1 for k in packs}     # every matrix and the lm_head, once a copy
    assert bb.kernel == "plain" and bb._copies == {}


@pytest.mark.parametrize("out, parts, rows", [(12, 2, 1), (12, 3, 4), (7, 2, 1), (7, 2, 3), (12, 1, 2)])
def test_split_linear_is_the_same_matmul_for_any_slab_count_and_row_count(out, parts, rows):
    """Slabs side by side give W's outputs in order; outputs that do not divide evenly fall back to one
    slab; the bias is added once."""
    w, b, x = torch.randn(out, 10), torch.randn(out), torch.randn(rows, 10)
    packed = split_pack(w, parts)
    assert packed.shape == ((parts, 10, out // parts) if out % parts == 0 else (1, 10, out))
    torch.testing.assert_close(split_linear(x, packed), x @ w.T)
    torch.testing.assert_close(split_linear(x, packed, b), x @ w.T + b)


def test_onednn_needs_fp32_on_a_cpu():
    assert not onednn_available(torch.device("cuda"), torch.float32)
    assert not onednn_available(torch.device("cpu"), torch.bfloat16)


@needs_onednn
@pytest.mark.parametrize("kernel", ["onednn", "split"])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_repacked_logits_match_plain(prompt, kernel):
    bb = tiny_backbone()
    ids = bb.encode(prompt)
    bb.set_kernel(kernel)
    fast = _logits(bb, ids)
    bb.set_kernel("plain")
    plain = _logits(bb, ids)
    assert not torch.equal(fast, torch.zeros_like(fast))
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_both_kernels_decode_like_transformers():
    """Greedy AR and speculative output, under each kernel, equal transformers' generate token for token."""
    bb = tiny_backbone()
    cfg = DecodeConfig(max_new_tokens=40, gamma=4)
    for prompt in PROMPTS:
        ids = bb.encode(prompt)
        ref = hf_greedy(bb, ids, 40)
        for kernel in ("onednn", "plain", "split", "plain/onednn", "onednn/plain", "split/onednn"):
            bb.set_kernel(kernel)
            for strategy in (Autoregressive(), Static(SkipSet(frozenset({0, 2}), frozenset({1, 3})))):
                assert generate(bb, ids, strategy, cfg).token_ids == ref, (prompt, kernel, strategy)


@needs_onednn
def test_weights_changed_repacks_the_verifier():
    """The packed copy is a copy: an in-place edit reaches the verifier only through weights_changed()."""
    bb = tiny_backbone()
    bb.set_kernel("onednn")
    x = torch.randn(2, bb.hidden)
    before = bb.head_logits(x)
    with torch.no_grad():
        bb.lm_head[7] += 10.0
    assert torch.equal(bb.head_logits(x), before)          # the stale copy: what the call below fixes
    bb.weights_changed()
    after = bb.head_logits(x)
    assert bb.kernel == "onednn"
    torch.testing.assert_close(after, torch.nn.functional.linear(x, bb.lm_head), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(after[:, 7], before[:, 7])


# --- the int8 draft's kernel per matrix -----------------------------------------------------------------
def test_the_draft_kernels_are_decided_by_whole_draft_passes_and_cached(monkeypatch, tmp_path):
    """Matrices that are faster alone in fp32 only propose a candidate: the whole draft pass decides (on
    one Xeon fp32 won q/k/v and o alone, and the draft pass ran 20% slower with them mixed in)."""
    monkeypatch.setenv("KNN_SSD_CACHE", str(tmp_path))
    alone = {m: {"int8": 10.0, "fp32": 20.0} for m in DRAFT_MATRICES}
    alone["qkv"] = {"int8": 30.0, "fp32": 20.0}
    monkeypatch.setattr(machine, "measure_draft_kernels", lambda bb: alone)
    passes = []
    monkeypatch.setattr(machine, "measure_draft_passes", lambda bb, cands: passes.append(cands) or [10.0, 12.0])
    bb = tiny_backbone()
    assert machine.fastest_draft_kernels(bb, measure_now=False) is None          # nothing cached yet
    every = {m: "int8" for m in DRAFT_MATRICES}
    assert machine.fastest_draft_kernels(bb) == every and len(passes) == 1       # the mixed pass lost
    assert passes[0] == [every, {**every, "qkv": "fp32"}]
    assert machine.fastest_draft_kernels(bb, measure_now=False) == every and len(passes) == 1   # cached
    monkeypatch.setattr(machine, "measure_draft_passes", lambda bb, cands: [12.0, 10.0])
    assert machine.fastest_draft_kernels(bb, refresh=True) == {**every, "qkv": "fp32"}
    monkeypatch.setattr(machine, "measure_draft_passes", lambda bb, cands: [10.0, 9.8])    # within the noise
    assert machine.fastest_draft_kernels(bb, refresh=True) == every


def test_a_draft_with_some_matrices_in_fp32_reads_the_verifiers_weights_and_stays_lossless():
    bb = tiny_backbone()
    kernels = {m: "int8" for m in DRAFT_MATRICES} | {"qkv": "fp32", "o": "fp32"}
    mixed, every = DraftWeights(bb, "int8", kernels=kernels), DraftWeights(bb, "int8")
    assert mixed.layers[0].wqkv is bb.layers[0].wqkv and mixed.layers[0].wo is bb.layers[0].wo
    assert not isinstance(mixed.layers[0].wgu, torch.Tensor)
    assert "q/k/v, o in fp32" in mixed.label and "fp32" not in every.label
    assert 0 < mixed.extra_bytes() < every.extra_bytes()
    bb.drafts.set_int8_kernels(kernels)                                           # decode with it
    cfg = DecodeConfig(max_new_tokens=24, gamma=3, draft="int8", lookup=False)
    skip = SkipSet({1}, {2}, "static")
    ar = generate(bb, "The cat sat on", Autoregressive(), cfg).token_ids
    assert generate(bb, "The cat sat on", Static(skip), cfg).token_ids == ar
    assert bb.drafts.get("int8", True, skip).kernels == kernels


def test_the_app_measures_the_draft_kernels_after_start_up(monkeypatch, tmp_path):
    """defer_choice (the app's start-up): the first int8 draft uses int8 everywhere without measuring;
    choose_int8_kernels measures later and drops drafts built on other kernels."""
    monkeypatch.setenv("KNN_SSD_CACHE", str(tmp_path))
    monkeypatch.delenv("SSD_DRAFT_KERNEL", raising=False)
    calls = []
    chosen = {m: "int8" for m in DRAFT_MATRICES} | {"o": "fp32"}
    monkeypatch.setattr(machine, "fastest_draft_kernels",
                        lambda bb, measure_now=True, refresh=False: calls.append(measure_now) or
                        (chosen if measure_now else None))
    monkeypatch.setattr(drafts_module, "fastest_draft_kernels", machine.fastest_draft_kernels)
    factory = DraftFactory(tiny_backbone())
    factory.defer_choice = True
    first = factory.get("int8", True, None)
    assert first.kernels == {m: "int8" for m in DRAFT_MATRICES} and calls == [False]
    assert factory.choose_int8_kernels() == chosen and calls[-1] is True
    again = factory.get("int8", True, None)
    assert again is not first and again.kernels == chosen
    fixed, measured = tiny_backbone().drafts, len(calls)     # kernels set by hand stay as they are
    fixed.set_int8_kernels({"o": "fp32"})
    assert fixed.choose_int8_kernels()["o"] == "fp32" and len(calls) == measured
    monkeypatch.setenv("SSD_DRAFT_KERNEL", "int8")
    assert DraftFactory(tiny_backbone()).int8_kernels() == {m: "int8" for m in DRAFT_MATRICES}


def test_building_a_cut_draft_hands_its_fp32_temporaries_back(monkeypatch):
    """Cut MLPs are made in fp32, then packed: the freed pages go back to the OS (malloc_trim), else
    the channel calibration's eight cut drafts left the app's RSS 1.2 GB higher for 0.3 GB of drafts."""
    calls = []
    monkeypatch.setattr(drafts_module, "release_freed_memory", lambda: calls.append(1))
    bb = tiny_backbone()
    inter = bb.layers[0].wdown.shape[1]
    bb.drafts.install_channels({"math": torch.arange(inter).repeat(bb.n_layers, 1)})
    skip = SkipSet(set(), set(), "math", channels="math", keep=0.5)
    bb.drafts.get("int8", True, skip)
    bb.drafts.get("int8", True, skip)                       # built once
    assert calls == [1]
    machine.release_freed_memory()                          # harmless where there is no glibc
