"""A tiny randomly initialised Llama with a character tokenizer: no download, builds in < 1 s."""
from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from ssd_core.engine.backbone import Backbone

SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \n")
    vocab = {t: i for i, t in enumerate(SPECIALS + chars)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>", additional_special_tokens=SPECIALS[3:])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_backbone(layers: int = 5, seed: int = 0, eos: bool = True) -> Backbone:
    tok = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, initializer_range=0.2, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id if eos else None, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    return Backbone(model, tok, name=f"tiny-llama-{layers}")
