"""Prompt encoding: the chat template, head-and-tail truncation, and the span of the user's tokens."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptIds:
    """A tokenised prompt, with the span of the user's own tokens (for pooling)."""

    ids: tuple[int, ...]
    user_span: tuple[int, int]
    text: str
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.ids)


def encode_prompt(tok, prompt: str, chat: bool | None = None, max_tokens: int | None = None) -> PromptIds:
    """Tokenise a user prompt (chat template for instruct models) and find the user's span."""
    use_chat = bool(getattr(tok, "chat_template", None)) if chat is None else chat
    truncated = False
    if max_tokens is not None:
        user_ids = tok(prompt, add_special_tokens=False).input_ids
        budget = max(8, max_tokens - (64 if use_chat else 0))
        if len(user_ids) > budget:
            # keep head and tail: instructions usually sit at one end, questions at the other
            head = budget // 2
            prompt = tok.decode(user_ids[:head]) + " … " + tok.decode(user_ids[-(budget - head - 4):])
            truncated = True
    if use_chat:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        at = text.rfind(prompt)
        ids = tok(text, add_special_tokens=False).input_ids
        if at >= 0:
            start = len(tok(text[:at], add_special_tokens=False).input_ids)
            stop = len(tok(text[:at + len(prompt)], add_special_tokens=False).input_ids)
        else:
            start, stop = 0, len(ids)
    else:
        text = prompt
        ids = tok(text).input_ids
        start, stop = 0, len(ids)
    if not ids:
        ids = [getattr(tok, "bos_token_id", None) or 0]
    return PromptIds(tuple(int(i) for i in ids), (start, max(stop, start + 1)), prompt, truncated)
