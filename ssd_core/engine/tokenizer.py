"""The warm path's tokenizer: a saved fast tokenizer read without importing transformers.

Importing transformers costs ~2 s on two cores (its lazy-import table and dependency checks), which a
warm start-up paid only to wrap `tokenizer.json` in `PreTrainedTokenizerFast`. For the plain folders
this project writes (`tokenizer.json` + `tokenizer_config.json` + `chat_template.jinja`), the fast
tokenizer does nothing beyond the `tokenizers` library and a Jinja chat template, so this class does
the same directly. `CachedTokenizer.read` returns None for anything it does not know how to mirror
(another tokenizer class, options such as `add_bos_token` or space clean-up): those load through
transformers as before. tests/test_tokenizer.py checks it against transformers' tokenizer.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")
# tokenizer_config.json keys that change nothing this class has to reproduce
_INERT = {"backend", "tokenizer_class", "model_max_length", "is_local", "local_files_only",
          "extra_special_tokens", "additional_special_tokens", "added_tokens_decoder"}
FAST_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")   # both: tokenizer.json


@dataclass
class Encoded:
    input_ids: list[int]


class CachedTokenizer:
    """The subset of transformers' fast-tokenizer interface the engine uses: call, decode,
    apply_chat_template (rendered, not tokenised) and the special-token ids."""

    def __init__(self, backend, specials: dict[str, str | None], chat_template: str | None):
        self._backend = backend
        self._template_tokens = {k: v for k, v in specials.items() if v is not None}
        self.chat_template = chat_template
        self._template = None
        for key, token in specials.items():
            setattr(self, key, token)
            setattr(self, key + "_id", None if token is None else backend.token_to_id(token))

    @classmethod
    def read(cls, folder: Path, config: dict | None = None) -> CachedTokenizer | None:
        """The tokenizer saved in `folder`, or None where only transformers can load it faithfully.
        config: its tokenizer_config.json, where the caller has read it already."""
        try:
            config = config if config is not None else json.loads((folder / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return None
        if config.get("tokenizer_class") not in FAST_TOKENIZER_CLASSES or not (folder / "tokenizer.json").exists():
            return None
        unknown = set(config) - _INERT - set(_SPECIALS) - {"clean_up_tokenization_spaces", "chat_template"}
        specials = {key: config.get(key) for key in _SPECIALS}
        if unknown or config.get("clean_up_tokenization_spaces") or not all(
                t is None or isinstance(t, str) for t in specials.values()):
            return None
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.exists() else config.get("chat_template")
        if template is not None and not isinstance(template, str):      # named templates: transformers
            return None
        from tokenizers import Tokenizer
        return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), specials, template)

    def __call__(self, text: str, add_special_tokens: bool = True) -> Encoded:
        return Encoded(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        if tokenize:
            raise NotImplementedError("render, then call the tokenizer with add_special_tokens=False")
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=None, documents=None, **self._template_tokens)


def _compile(source: str):
    """A chat template in the sandbox and dialect the Hub's templates are written for (blocks trimmed,
    loop controls, `raise_exception`, a `tojson` that does not HTML-escape, `strftime_now`)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)
