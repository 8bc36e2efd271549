"""The warm-cache path: a cached plain Llama read straight into a Backbone, without transformers'
model class (its import alone was ~3 s of the warm start-up). It must give the very same Backbone."""
import json
import logging

import pytest
import torch

from ssd_core.engine import loading
from ssd_core.engine.backbone import Backbone
from ssd_core.engine.weights import plain_llama_rope_theta
from ssd_core.engine.decode import DecodeConfig
from ssd_core.engine.generate import generate
from ssd_core.engine.skipset import SkipSet
from ssd_core.policies.ar import Autoregressive
from ssd_core.policies.static import Static

CPU = torch.device("cpu")
PROMPT = "cached weights, same answers"


def assert_same_backbone(a: Backbone, b: Backbone) -> None:
    for name in ("embed", "lm_head", "norm", "cos", "sin_rot"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        for slot in la.__slots__:
            x, y = getattr(la, slot), getattr(lb, slot)
            assert (x is None and y is None) or torch.equal(x, y), slot
    fields = ("n_layers", "hidden", "n_heads", "n_kv", "head_dim", "eps", "vocab", "max_positions",
              "eos_ids", "attn_params", "mlp_params", "other_params", "dtype")
    assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]


def _load(folder):
    return loading._load_cached(folder, torch.float32, "tiny-cached", CPU, 8192)


def test_cached_model_reads_into_the_same_backbone(tiny, cached_tiny):
    bb = _load(cached_tiny)
    assert bb is not None and bb._hf_model is None          # transformers' model not built
    assert_same_backbone(bb, tiny)
    ids = tiny.encode(PROMPT).ids
    assert bb.encode(PROMPT) == tiny.encode(PROMPT)
    assert torch.equal(bb.forward(ids, bb.new_cache(64), logits="all"),
                       tiny.forward(ids, tiny.new_cache(64), logits="all"))
    cfg = DecodeConfig(max_new_tokens=16, gamma=3)
    ar = generate(tiny, PROMPT, Autoregressive(), cfg).token_ids
    assert generate(bb, PROMPT, Static(SkipSet({1}, {2, 3})), cfg).token_ids == ar


def test_the_reference_model_is_built_on_first_use(cached_tiny):
    bb = _load(cached_tiny)
    hf = bb.hf_model
    assert bb.hf_model is hf and not hf.training
    assert_same_backbone(Backbone(hf, bb.tokenizer, name="reference"), bb)


@pytest.mark.parametrize("change", [{"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                                    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}},
                                    {"model_type": "qwen2"}, {"attention_bias": True}, {"hidden_act": "gelu"}])
def test_other_models_take_transformers_path(cached_tiny, change):
    path = cached_tiny / "config.json"
    cfg = json.loads(path.read_text())
    assert plain_llama_rope_theta(cfg) is not None
    cfg.update(change)
    assert plain_llama_rope_theta(cfg) is None
    path.write_text(json.dumps(cfg))
    assert _load(cached_tiny) is None


def test_a_broken_cache_falls_back_with_a_warning(cached_tiny, caplog):
    (cached_tiny / "model.safetensors").write_bytes(b"not safetensors")
    with caplog.at_level(logging.WARNING):
        assert _load(cached_tiny) is None
    assert "not read directly" in caplog.text
    assert _load(cached_tiny.parent / "missing") is None


@pytest.mark.real
def test_warm_default_model_equals_the_converted_one(real_model, model_cache, monkeypatch):
    """The second load of the embedded model (from the cache the first one wrote) gives the same
    tensors, tokens and chat template as the conversion, and both equal transformers' own model."""
    monkeypatch.setenv("KNN_SSD_CACHE", str(model_cache))
    warm = loading.load_backbone(threads=2)
    assert warm._hf_model is None                       # transformers' model not built
    assert_same_backbone(warm, real_model)
    assert_same_backbone(Backbone(warm.hf_model, warm.tokenizer, name="from the cache"), warm)
    assert_same_backbone(Backbone(real_model.hf_model, real_model.tokenizer, name="from the GGUF"), warm)
    for text in ["Translate German to English: Der Zug fährt um acht Uhr ab.", "def f(x):\n    return x ** 2"]:
        assert warm.encode(text) == real_model.encode(text)
        ids = warm.encode(text).ids
        assert warm.decode(ids) == real_model.decode(ids)


@pytest.mark.real
@pytest.mark.slow
def test_a_cold_start_parses_the_gguf_once(tmp_path, monkeypatch):
    """The tokenizer (transformers) and the weights (ours) come from one parse of the GGUF's metadata."""
    import gguf
    built = []

    class Counting(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            built.append(args[0])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    monkeypatch.setenv("KNN_SSD_CACHE", str(tmp_path))
    bb = loading.load_backbone(threads=2)
    assert len(built) == 1 and bb.n_layers == 30
    assert [p.name for p in tmp_path.iterdir() if (p / "model.safetensors").exists()]   # beside kernels.json
