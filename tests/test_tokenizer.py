"""The warm path's tokenizer (no transformers import) against transformers' own tokenizer of the same
folder: the same ids, the same decoded text, the same chat text, the same special tokens."""
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from ssd_core.engine import loading
from ssd_core.engine.tokenizer import CachedTokenizer

ROOT = Path(__file__).resolve().parents[1]
TEXTS = ["", "Hello there, what is 2+2?", "  leading and trailing spaces  ", "line one\nline two\n\n\ttabbed",
         "def f(x):\n    return x ** 2  # square", "Übersetze: Der Zug fährt um acht Uhr ab. 東京は晴れ 🚆",
         "who wrote the origin of species", "special tokens typed as text: <s> </s> <|im_start|>user <|im_end|>"]


def assert_same(ours: CachedTokenizer, theirs: PreTrainedTokenizerFast, rng: random.Random) -> None:
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.chat_template == theirs.chat_template
    for text in TEXTS:
        for special in (True, False):
            assert ours(text, add_special_tokens=special).input_ids == \
                theirs(text, add_special_tokens=special).input_ids, (text, special)
        for generation in (True, False):
            messages = [{"role": "user", "content": text}]
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation) == \
                theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        chat = ours(ours.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                    add_special_tokens=False).input_ids
        some = [rng.randrange(len(theirs)) for _ in range(40)]
        for ids in (chat, some, ours(text).input_ids):
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == \
                    theirs.decode(ids, skip_special_tokens=skip), (ids, skip)


def test_the_cached_tokenizer_equals_transformers(cached_tiny):
    ours = CachedTokenizer.read(cached_tiny)
    assert ours is not None and ours.chat_template
    assert_same(ours, PreTrainedTokenizerFast.from_pretrained(cached_tiny), random.Random(0))


@pytest.mark.parametrize("change", [{"clean_up_tokenization_spaces": True}, {"add_bos_token": True},
                                    {"tokenizer_class": "LlamaTokenizer"}, {"some_new_option": 1}])
def test_options_it_does_not_mirror_go_through_transformers(cached_tiny, change):
    path = cached_tiny / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    assert CachedTokenizer.read(cached_tiny) is None
    if "tokenizer_class" not in change:          # the model still loads, with transformers' tokenizer
        bb = loading._load_cached(cached_tiny, loading.torch.float32, "tiny", loading.torch.device("cpu"), 512)
        assert isinstance(bb.tokenizer, PreTrainedTokenizerFast)


def test_the_warm_path_uses_it(cached_tiny):
    bb = loading._load_cached(cached_tiny, loading.torch.float32, "tiny", loading.torch.device("cpu"), 512)
    assert isinstance(bb.tokenizer, CachedTokenizer)


@pytest.mark.real
def test_the_default_models_cached_tokenizer_equals_transformers(real_model, model_cache):
    folder = next(p.parent for p in model_cache.glob("*/tokenizer.json"))
    ours = CachedTokenizer.read(folder)
    assert ours is not None and ours.eos_token == "<|im_end|>"
    assert_same(ours, PreTrainedTokenizerFast.from_pretrained(folder), random.Random(1))


def test_a_warm_load_does_not_import_transformers(cached_tiny):
    """The point of CachedTokenizer: importing transformers cost ~2 s of a warm start-up."""
    code = ("import sys, torch\nfrom pathlib import Path\nfrom ssd_core.engine import loading\n"
            f"bb = loading._load_cached(Path({str(cached_tiny)!r}), torch.float32, 'tiny', torch.device('cpu'), 512)\n"
            "assert bb is not None and bb.encode('warm').ids\n"
            "assert 'transformers' not in sys.modules, 'transformers was imported'\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
