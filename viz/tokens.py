"""Decode events → coloured token HTML with hover details, and the colour legend.

Per verification step the order on screen is what happened: the accepted drafts (green), the
rejected drafts where they were proposed (red, struck through), then the verifier's own token
(blue, underlined) that replaced the first rejected draft or was the bonus after a full accept.
Hover details live in `data-tip` (shown by the app's tooltip script) and in `aria-label`.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Callable

from .theme import KINDS

TokenStr = Callable[[int], str]


@dataclass(frozen=True)
class Token:
    text: str
    kind: str                 # accepted | rejected | verifier
    step: int | None          # 1-based verification step; None = the prefill's token
    tip: str
    eos: bool = False
    lookup: bool = False      # a draft copied from earlier text (prompt lookup), not made by the model


def escape(text: str) -> str:
    """HTML-escape, and neutralise template syntax ({{ }}, ${ }) the HTML component might expand."""
    return html.escape(text, quote=True).replace("{", "&#123;").replace("}", "&#125;").replace("$", "&#36;")


def _shown(text: str, kind: str) -> str:
    """Text as displayed: whitespace-only drafts that were thrown away still need to be visible."""
    if kind == "rejected":
        text = text.replace("\n", "↵")
        if text.strip() == "":
            text = text.replace(" ", "␣") or "∅"
    elif text == "":
        text = "∅"
    return text


def _quote(text: str) -> str:
    return "“" + text.replace("\n", "↵") + "”"


def start_tokens(first_token: int, token_str: TokenStr, eos_ids=frozenset()) -> list[Token]:
    return [Token(token_str(first_token), "verifier", None,
                  "prefill · the full model's first token", first_token in eos_ids)]


def step_tokens(step, token_str: TokenStr, eos_ids=frozenset()) -> list[Token]:
    """The tokens one Step shows, in display order."""
    n = step.index + 1
    out: list[Token] = []
    committed = step.committed
    shown_accepted = min(step.accepted, len(committed))
    lookup = getattr(step, "source", "") == "lookup"
    vp = getattr(step, "verify_probs", ()) or ()

    def verifier_p(i: int) -> str:
        return f" (p = {vp[i]:.2f})" if i < len(vp) else ""
    who = "lookup draft (copied from earlier text)" if lookup else "draft"
    for i in range(shown_accepted):
        t = step.drafted[i]
        p = "" if lookup else f" · draft p = {step.draft_probs[i]:.2f}"
        out.append(Token(token_str(t), "accepted", n,
                         f"step {n} · accepted {who} {i + 1}/{len(step.drafted)}{p} · verifier agreed{verifier_p(i)}",
                         t in eos_ids, lookup))
    bonus = committed[step.accepted] if len(committed) > step.accepted else None
    for j, t in enumerate(step.rejected):
        i = step.accepted + j
        if j == 0:
            verdict = (f"verifier chose {_quote(token_str(bonus))}" if bonus is not None
                       else "cut at end of text")
        else:
            verdict = "discarded after the first mismatch"
        p = "" if lookup else f" · draft p = {step.draft_probs[i]:.2f}"
        out.append(Token(token_str(t), "rejected", n,
                         f"step {n} · rejected {who} {i + 1}/{len(step.drafted)}{p} · {verdict}",
                         t in eos_ids, lookup))
    if bonus is not None:
        if not step.speculative:
            tip = f"step {n} · verifier token · autoregressive step (no drafts)"
        elif step.rejected:
            tip = (f"step {n} · verifier token · replaces rejected draft "
                   f"{_quote(token_str(step.rejected[0]))}")
        elif step.drafted:
            tip = f"step {n} · verifier token · bonus after {step.accepted} accepted drafts"
        else:
            tip = f"step {n} · verifier token · the draft stopped early (below the threshold)"
        out.append(Token(token_str(bonus), "verifier", n, tip + verifier_p(step.accepted), bonus in eos_ids))
    return out


def token_html(tok: Token) -> str:
    cls = {"accepted": "acc", "rejected": "rej", "verifier": "ver"}[tok.kind]
    cls += " eos" if tok.eos else ""
    cls += " look" if tok.lookup else ""
    text = "⟨end⟩" if tok.eos else _shown(tok.text, tok.kind)
    tip = escape(tok.tip)
    return (f'<span class="tok {cls}" data-step="{tok.step or 0}" '
            f'data-tip="{tip}" aria-label="{escape(tok.text)} — {tip}">{escape(text)}</span>')


def tokens_html(tokens) -> str:
    return "".join(token_html(t) for t in tokens)


def stream_html(body: str, *, placeholder: str = "", status: str = "") -> str:
    """The output box: the prompt's coloured continuation (or a placeholder) and a status line."""
    inner = body or f'<span class="placeholder">{escape(placeholder)}</span>'
    foot = f'<div class="stream-status">{status}</div>' if status else ""
    return f'<div class="token-stream" role="log" aria-live="polite">{inner}</div>{foot}'


def legend_html() -> str:
    items = []
    for k in KINDS.values():
        cls = {"accepted": "acc", "rejected": "rej", "verifier": "ver"}[k.name]
        sample = {"accepted": "drafted", "rejected": "thrown", "verifier": "checked"}[k.name]
        items.append(f'<span class="legend-item"><span class="tok {cls}">{sample}</span> '
                     f'{escape(k.label)}<span class="legend-mark"> ({escape(k.mark)})</span></span>')
    items.append('<span class="legend-item"><span class="tok acc look">copied</span> '
                 'prompt-lookup draft<span class="legend-mark"> (dashed frame)</span></span>')
    return ('<div class="legend" aria-label="token colours">' + "".join(items)
            + "</div>")
