"""The verifier's matmul kernel: oneDNN-prepacked fp32 weights vs F.linear on the weights as loaded.

Prepacking changes only the summation order of the same fp32 arithmetic; these tests hold both kernels
to each other and to transformers' `generate`, for autoregressive and speculative decoding.
"""
import ctypes.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_reference import hf_greedy
from ssd_core.engine import backbone as backbone_module, machine
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


@needs_onednn
def test_measure_kernels_times_each_kernel_on_its_own_pass_shape(monkeypatch, tmp_path):
    """A kernel made slow only for one row (oneDNN) or only for several rows (split) is the slowest of
    that shape alone, and the chooser picks another kernel there: the timings are of the kernel and the
    row count they are filed under."""
    monkeypatch.setenv("SSD_KERNEL", "plain")             # no repacked copies yet: the slowed ones are made
    monkeypatch.setenv("KNN_SSD_CACHE", str(tmp_path))
    bb = tiny_backbone()
    rows_seen = {"onednn": set(), "split": set()}

    def slowed(kernel, real, slow_rows):
        def linear(x, w, b=None):
            rows_seen[kernel].add(x.shape[0])
            if (x.shape[0] > 1) == slow_rows:
                time.sleep(0.003)                         # ~60 ms a pass on the tiny model's 21 matmuls
            return real(x, w, b)
        return linear
    monkeypatch.setattr(backbone_module, "onednn_linear", slowed("onednn", backbone_module.onednn_linear, False))
    monkeypatch.setattr(backbone_module, "split_linear", slowed("split", backbone_module.split_linear, True))
    timing = machine.measure_kernels(bb, rows=(1, 3), repeats=3)
    assert set(timing) == {1, 3} and all(set(t) == set(machine.KERNELS) for t in timing.values())
    assert rows_seen == {"onednn": {1, 3}, "split": {1, 3}}
    assert max(timing[1], key=timing[1].get) == "onednn", timing
    assert max(timing[3], key=timing[3].get) == "split", timing
    assert timing[1]["onednn"] > 0.05 and timing[3]["split"] > 0.05, timing
    one, many = machine.fastest_kernels(bb, refresh=True)
    assert one != "onednn" and many != "split", (one, many)


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


# --- drafts hand their temporaries back ----------------------------------------------------------------
CUT_DRAFTS_RSS = r"""
import json, os, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from tiny import tiny_tokenizer
from ssd_core.engine.backbone import Backbone
from ssd_core.engine.skipset import SkipSet

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

torch.set_num_threads(2)
torch.manual_seed(0)
tok = tiny_tokenizer()     # SmolLM2-135M's width and MLP, six layers: cut MLPs of ~1.8 MB, as in the app
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=6,
                  num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
bb = Backbone(LlamaForCausalLM(cfg).eval(), tok, name="rss")
inter = bb.layers[0].wdown.shape[1]
names = [f"r{i}" for i in range(8)]       # the channel calibration's eight cut MLP sets
bb.drafts.install_channels({n: torch.stack([torch.randperm(inter) for _ in range(bb.n_layers)]) for n in names})
bb.drafts.get("int8", True, None)
before = rss()
sets = [SkipSet(set(), set(), "x", channels=n, keep=0.5) for n in names]
cut = [bb.drafts.get("int8", True, s) for s in sets]
assert all(bb.drafts.get("int8", True, s) is d for s, d in zip(sets, cut))      # built once
print(json.dumps({"growth": rss() - before, "live": sum(d.extra_bytes(mlp_only=True) for d in cut)}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm") or ctypes.util.find_library("c") != "libc.so.6",
                    reason="malloc_trim: glibc on Linux")
def test_building_cut_drafts_hands_their_fp32_temporaries_back_to_the_os():
    """Cut MLPs are made in fp32, then packed in two threads: without handing the freed pages back
    (malloc_trim), the channel calibration's eight cut drafts left the app's RSS 1.2 GB higher for 0.3 GB
    of drafts. In a fresh process, the RSS grows by about what the cut drafts hold (measured here: 1.1-1.4×
    their bytes; without the trim 2.0-2.8×)."""
    run = subprocess.run([sys.executable, "-c", CUT_DRAFTS_RSS], cwd=Path(__file__).parent, capture_output=True,
                         text=True, timeout=300,
                         env={**os.environ, "SSD_KERNEL": "plain", "PYTHONPATH": str(Path(__file__).parents[1])})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["live"] > 20 * 2**20
    assert out["growth"] < 1.7 * out["live"], (f"RSS grew {out['growth'] / 2**20:.0f} MB for "
                                               f"{out['live'] / 2**20:.0f} MB of cut drafts")
