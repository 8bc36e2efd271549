"""Step-through (teaching): one verification step shown phase by phase.

draft  → the γ draft tokens with their probabilities as little bars;
verify → the verifier's token at every position, aligned under the drafts;
accept → the matching prefix (green), the first mismatch (red, struck) and the verifier's
         correction or bonus token (blue) that is committed with it.
"""
from __future__ import annotations

from .tokens import escape

PHASES = ("draft", "verify", "accept")

CAPTIONS = {
    "draft": "Draft: the model runs with {skip} skipped and proposes {n} token{s}, one after another.",
    "verify": "Verify: one pass of the full model over all {n} draft{s} at once gives its own choice at "
              "every position (and one more after the last).",
    "accept": "Accept: keep drafts up to the first mismatch; the verifier's token there is committed too. "
              "{k} of {n} accepted → {c} new token{cs} this step.",
}


def _cell(text: str, cls: str, tip: str = "") -> str:
    shown = text.replace("\n", "↵")
    if shown.strip() == "":
        shown = shown.replace(" ", "␣") or "∅"
    return f'<td class="{cls}" data-tip="{escape(tip)}"><span>{escape(shown)}</span></td>'


def _prob_cell(p: float) -> str:
    return (f'<td class="prob"><div><span class="pbar"><span style="width:{100 * p:.0f}%"></span></span>'
            f'<span class="pnum">{p:.2f}</span></div></td>')


def context_html(text: str, width: int = 260) -> str:
    tail = text[-width:]
    lead = "…" if len(text) > width else ""
    return f'<div class="walk-context">{escape(lead + tail)}<span class="cursor">▍</span></div>'


def walk_html(context: str, step, phase: str, token_str, skip_desc: str = "the chosen sublayers",
              total_steps: str = "") -> str:
    """The step-through panel for `step` (a decode.Step) at `phase`; step None = nothing yet."""
    if step is None:
        return ('<div class="walk idle">Type a prompt and press <b>Start</b>: the prompt is prefilled, then '
                "each click shows one phase of one speculative step.</div>")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    n = len(step.drafted)
    head = f'<div class="walk-head">step {step.index + 1}{total_steps} · phase: <b>{phase}</b></div>'
    if n == 0:
        tok = token_str(step.committed[0]) if step.committed else ""
        body = ('<table class="walk-table"><tr><th>full model</th>'
                + _cell(tok, "ver", "autoregressive step") + "</tr></table>"
                + '<p class="walk-caption">No drafts this step (autoregressive, or the draft stopped below '
                  "the threshold): the full model produced one token.</p>")
        return f'<div class="walk">{head}{context_html(context)}{body}</div>'
    cols = n + 1
    header = "".join(f"<th>{i + 1}</th>" for i in range(n)) + "<th>+1</th>"
    rows = [f'<tr class="pos"><th></th>{header}</tr>']
    draft_cells = []
    for i, t in enumerate(step.drafted):
        cls = "draft"
        if phase == "accept":
            cls = "acc" if i < step.accepted else ("rej" if i == step.accepted else "gone")
        draft_cells.append(_cell(token_str(t), cls, f"draft {i + 1}: p = {step.draft_probs[i]:.2f}"))
    rows.append(f'<tr><th>draft</th>{"".join(draft_cells)}<td class="empty"></td></tr>')
    rows.append('<tr class="probs"><th>p(draft)</th>' + "".join(_prob_cell(p) for p in step.draft_probs)
                + '<td class="empty"></td></tr>')
    if phase in ("verify", "accept"):
        ver_cells = []
        for i in range(cols):
            if i >= len(step.verified):
                ver_cells.append('<td class="empty"></td>')
                continue
            t = step.verified[i]
            if phase == "accept":
                cls = ("match" if i < step.accepted else "ver" if i == step.accepted else "gone")
            else:
                cls = "ver-plain"
            agree = i < n and step.drafted[i] == t
            ver_cells.append(_cell(token_str(t), cls, "agrees with the draft" if agree else
                                   ("the verifier's choice" if i < n else "one more token, for free")))
        rows.append(f'<tr><th>verifier</th>{"".join(ver_cells)}</tr>')
    if phase == "accept":
        marks = []
        for i in range(cols):
            if i < step.accepted:
                marks.append('<td class="mark ok">✓</td>')
            elif i == step.accepted and i < n:
                marks.append('<td class="mark bad">✗ → use verifier</td>')
            elif i == step.accepted:
                marks.append('<td class="mark ok">bonus</td>')
            else:
                marks.append('<td class="mark">discarded</td>')
        rows.append(f'<tr><th>verdict</th>{"".join(marks)}</tr>')
    c = len(step.committed)
    caption = CAPTIONS[phase].format(skip=escape(skip_desc), n=n, s="" if n == 1 else "s",
                                     k=step.accepted, c=c, cs="" if c == 1 else "s")
    if phase == "accept":
        committed = "".join(token_str(t) for t in step.committed)
        caption += f" Committed: “{escape(committed)}”."
    table = f'<table class="walk-table">{"".join(rows)}</table>'
    return (f'<div class="walk">{head}{context_html(context)}{table}'
            f'<p class="walk-caption">{caption}</p></div>')
