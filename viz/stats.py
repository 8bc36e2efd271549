"""Live statistics as small HTML (cheap to re-send every step): τ, α, tokens/s, the histogram of
accept lengths, drafted vs accepted per step, and the race verdict."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ssd_core.engine.ties import NEAR_TIE

from .tokens import escape


@dataclass(frozen=True)
class RaceResult:
    """Both runs of a race on the same prompt and settings, measured in this process."""

    strategy: str                 # display label of the challenger
    ar_tokens_per_s: float
    tokens_per_s: float
    ar_tokens: int
    tokens: int
    identical: bool | None        # None: sampling, where lossless means "same distribution"
    first_difference: int | None = None
    tie_gap: float | None = None  # the full model's top-2 logit gap where the texts part (greedy only)
    against: str = "autoregressive"   # the second lap: plain decoding, or the "static draft" (Race vs static)
    tau: float | None = None          # Race vs static: τ of both laps, the sets they drafted with,
    against_tau: float | None = None  # and whether the routed draft is the static one
    sets: tuple[str, str] | None = None
    same_draft: bool | None = None
    costs: dict | None = None         # Race vs AR: this run's own c and v (engine.race.measured_costs)
    spread: tuple[float, float] | None = None   # the ratio over each third of the laps: (lowest, highest)

    def __post_init__(self):
        if self.spread is not None:           # a trace's JSON gives it back as a list
            object.__setattr__(self, "spread", tuple(self.spread))

    @property
    def speedup(self) -> float:
        return self.tokens_per_s / self.ar_tokens_per_s if self.ar_tokens_per_s > 0 else 0.0


def _metric(label: str, value: str, hint: str, cls: str = "") -> str:
    return (f'<div class="metric {cls}" title="{escape(hint)}"><span class="metric-value">{escape(value)}</span>'
            f'<span class="metric-label">{escape(label)}</span></div>')


def speedup_class(x: float) -> str:
    return "good" if x >= 1.0 else "bad"


def stats_html(stats=None, *, race: RaceResult | None = None, speculative: bool = True,
               note: str = "", steps=(), gamma: int = 4) -> str:
    """The stats line: τ, α, tokens/s, the race's speedup and lossless check, then the live histogram of
    tokens per step and the drafted-vs-accepted strip."""
    if stats is None:
        cells = [_metric("τ tokens/step", "–", "mean tokens committed per verification step"),
                 _metric("α acceptance", "–", "accepted drafts / drafted tokens"),
                 _metric("tokens/s", "–", "new tokens per second of model time")]
    else:
        cells = [_metric("τ tokens/step", f"{stats.tau:.2f}",
                         "mean tokens committed per verification step (accepted drafts + the verifier's token)"),
                 _metric("α acceptance", f"{stats.alpha:.2f}" if speculative and stats.drafted else "–",
                         f"{stats.accepted} of {stats.drafted} drafted tokens accepted"),
                 _metric("tokens/s", f"{stats.tokens_per_s:.1f}",
                         f"{stats.new_tokens} tokens in {stats.wall_s:.2f} s of model time "
                         f"(prefill {stats.prefill_s * 1000:.0f} ms)")]
    if race is not None:
        versus = "vs AR" if race.against == "autoregressive" else "vs static"
        cells.append(_metric(versus, f"{race.speedup:.2f}×",
                             f"measured: {race.tokens_per_s:.1f} vs {race.ar_tokens_per_s:.1f} tokens/s "
                             f"({race.against}), same prompt, same process, laps in lockstep, decode phase",
                             speedup_class(race.speedup)))
        cells.append(_lossless_metric(race))
    else:
        cells.append(_metric("vs AR", "race →", "press “Race vs AR” to measure the speedup",
                             "pending"))
    extra = f'<div class="stats-note">{escape(note)}</div>' if note else ""
    lengths = [len(s.committed) for s in steps]
    return (f'<div class="stats-line"><div class="stats-bar">{"".join(cells)}</div>'
            f"{accept_histogram_html(lengths, gamma)}{steps_strip_html(steps)}</div>{batch_html(steps, speculative)}"
            f"{extra}")


def batch_words(steps, speculative: bool = True) -> str:
    """The shared batch in words: how many others the last step's passes carried and what the goodput rule
    chose for it (Step.rows, Step.rule), then how many of the run's steps were shared."""
    steps = list(steps)
    if not steps:
        return ""
    last = steps[-1]
    if last.rows <= 1:
        words = "alone in the batch: " + ("the strategy's own draft length" if speculative else "plain decoding")
    else:
        others = last.rows - 1
        words = f"shared with {others} other{'s' if others != 1 else ''}"
        if last.rule:      # "4 rows shared this step: draft length 0 (…) — predicted 230 tokens/s for all rows …"
            chose = last.rule.partition("shared this step: ")[2] or last.rule
            words += " · " + chose.replace(" tokens/s for all rows", " tok/s for all").replace(" — ", ": ", 1)
        else:              # the others were reading their prompts: the rule had no decoding rows to weigh
            words += " (reading their prompts) · the strategy's own draft length"
    shared = [s.rows for s in steps if s.rows > 1]
    if shared:
        words += f" · {len(shared)} of {len(steps)} steps shared, up to {max(shared)} rows"
    return words


def batch_html(steps, speculative: bool = True) -> str:
    words = batch_words(steps, speculative)
    return (f'<div class="stats-batch" title="every visitor\'s request is a row of one batched pass; the goodput '
            'rule sets each shared step\'s draft length" style="font-size:12px;color:var(--muted);margin-top:3px">'
            f"{escape(words)}</div>") if words else ""


def _lossless_metric(race: RaceResult) -> str:
    if race.identical is None:
        return _metric("lossless", "n/a", "sampling: outputs differ run to run; speculative sampling keeps "
                       "the distribution, not the text", "pending")
    if race.identical:
        return _metric("lossless", "✓ same", "token-for-token identical to autoregressive decoding", "good")
    where = f" (first difference at token {race.first_difference})" if race.first_difference is not None else ""
    return _metric("lossless", "✗ differs", "the text differs from autoregressive decoding" + where, "bad")


def accept_histogram_html(accept_lengths, gamma: int) -> str:
    """Bars: how often a step committed 1, 2, …, γ+1 tokens."""
    counts = Counter(accept_lengths)
    top = max(gamma + 1, max(counts, default=1))
    peak = max(counts.values(), default=0)
    bars = []
    for n in range(1, top + 1):
        c = counts.get(n, 0)
        h = 0 if peak == 0 else max(2, round(34 * c / peak)) if c else 0
        bars.append(f'<div class="hbar" title="{c} step{"s" if c != 1 else ""} committed {n} token'
                    f'{"s" if n != 1 else ""}"><div class="hbar-fill" style="height:{h}px"></div>'
                    f'<div class="hbar-x">{n}</div></div>')
    return ('<div class="mini"><div class="mini-title">tokens per step</div>'
            f'<div class="hist">{"".join(bars)}</div></div>')


def steps_strip_html(steps, last: int = 40) -> str:
    """One column per step: accepted (green) and rejected (red) drafts, then the verifier token (blue)."""
    shown = list(steps)[-last:]
    cols = []
    for s in shown:
        acc = min(s.accepted, len(s.committed))
        rej = len(s.drafted) - s.accepted
        ver = 1 if len(s.committed) > s.accepted else 0
        cells = ('<i class="v"></i>' * ver + '<i class="r"></i>' * rej + '<i class="a"></i>' * acc)
        cols.append(f'<div class="scol" title="step {s.index + 1}: drafted {len(s.drafted)}, accepted '
                    f'{s.accepted}">{cells}</div>')
    empty = '<span class="mini-empty">steps appear here</span>' if not cols else ""
    return ('<div class="mini"><div class="mini-title">drafted vs accepted, per step</div>'
            f'<div class="strip">{"".join(cols)}{empty}</div></div>')


def difference_words(position: int | None, gap: float | None) -> str:
    """Why two greedy texts part: a floating-point near-tie (say how close) or a real difference."""
    where = f" at token {position + 1}" if position is not None else ""
    if gap is not None and gap < NEAR_TIE:
        return (f"≈ the texts part{where} at a near-tie: the model's two best next tokens there are {gap:.1e} "
                "apart in logit, within float rounding of a 1-row pass (autoregressive) vs a multi-row pass "
                "(verification); not a drafting error")
    return f"✗ the texts differ{where}" + (f" (top-2 logit gap there {gap:.3g}: not a tie)" if gap is not None
                                           else "")


def routing_gain_words(race: RaceResult) -> str:
    """Race vs static in one sentence: what the routed draft gained over the static one, or why nothing."""
    if race.same_draft:
        return ("Same draft as static: this domain's own set did not beat the static set at calibration, so "
                "routing sends it to the static set; both laps do the same work, so the ratio measures the "
                "timing's own noise.")
    t = (race.tau / race.against_tau) if race.tau and race.against_tau else None
    tau = f"τ {t:.2f}× the static draft's" if t else "τ not comparable"
    return (f"Routing's own gain on this prompt: {tau}, {race.speedup:.2f}× its tokens/s "
            "(one prompt: a benchmark averages many).")


def race_html(race: RaceResult | None, *, running: str = "") -> str:
    """The race panel: both speeds as bars, the measured speedup, the lossless check."""
    if race is None:
        body = escape(running) if running else ("Race vs AR runs the chosen strategy and plain autoregressive "
                                               "decoding on the same prompt, step by step in lockstep so both "
                                               "meet the machine in the same state; Race vs static runs the "
                                               "routed draft against the static one.")
        return f'<div class="race idle">{body}</div>'
    fast = max(race.tokens_per_s, race.ar_tokens_per_s, 1e-9)
    rows = []
    static = race.against_tau is not None
    for label, tps, n, cls, tau, sets in (
            (race.strategy, race.tokens_per_s, race.tokens, "challenger", race.tau, (race.sets or ("",))[0]),
            (race.against, race.ar_tokens_per_s, race.ar_tokens, "ar", race.against_tau, (race.sets or ("", ""))[1])):
        extra = f" · τ {tau:.2f}" if static and tau is not None else ""
        rows.append(f'<div class="race-row {cls}"><span class="race-label">{escape(label)}</span>'
                    f'<span class="race-bar"><span style="width:{100 * tps / fast:.1f}%"></span></span>'
                    f'<span class="race-num">{tps:.1f} tok/s · {n} tokens{extra}</span></div>'
                    + (f'<div class="race-set">{escape(sets)}</div>' if static and sets else ""))
    if static:
        rows.append(f'<div class="race-note">{escape(routing_gain_words(race))}</div>')
    if race.identical is None:
        verdict = "sampling mode: lossless means the same distribution, not the same text"
    elif race.identical:
        verdict = "✓ identical text: speculation changed nothing but the speed"
    else:
        verdict = difference_words(race.first_difference, race.tie_gap)
    spread = ""
    if race.spread is not None:
        lo, hi = race.spread
        spread = ('<div class="race-note">Measured in lockstep over the decode phase (each lap\'s first step '
                  f'warms up, uncounted); over each third of the laps the ratio read {lo:.2f}–{hi:.2f}×.</div>')
    head = (f'<span class="race-speedup {speedup_class(race.speedup)}">{race.speedup:.2f}×</span> '
            f'<span class="race-verdict">{escape(verdict)}</span>')
    return f'<div class="race">{head}{"".join(rows)}{spread}</div>'
