"""Decode loops as generators of small immutable events.

`decode(...)` yields one `Start` event (after prefill and the strategy's routing),
then one `Step` per verification step. Autoregressive steps are Steps with no
drafts. The app, the benchmark and the tests all consume these same events
(engine.events); the step itself is engine.rows, for one sequence or many.
"""
from __future__ import annotations

from typing import Iterator

from .backbone import Backbone
from .events import (DecodeConfig, DecodeState, Start, Step, Waiting, _probs, _sample,  # noqa: F401 - re-exported
                     _speculative_sample)
from .prompt import PromptIds
from .rows import Row, advance
from .strategy import Strategy


# --- the loop -----------------------------------------------------------------------------------
def encode_for(backbone: Backbone, prompt: str, config: DecodeConfig) -> PromptIds:
    """The prompt as `decode` runs it: tokenised, shortened to leave room in the context for the answer."""
    room = backbone.max_positions - config.max_new_tokens - config.gamma - 2
    if room < 72:
        raise ValueError(f"max_new_tokens={config.max_new_tokens} leaves no room for a prompt in "
                         f"the model's {backbone.max_positions}-token context")
    return backbone.encode(prompt, max_tokens=min(config.max_prompt_tokens or room, room))


def decode(backbone: Backbone, prompt: PromptIds | str, strategy: Strategy | None = None,
           config: DecodeConfig = DecodeConfig(), should_stop=None, lookahead: int | None = None,
           report_wait: bool = False, group=None) -> Iterator[Start | Step]:
    """Prefill, then speculative (or autoregressive) steps until EOS or max_new_tokens.

    should_stop: optional callable polled once per step (cancellation).
    With a serving engine attached to the backbone (engine.serve.Engine.attach) the request joins its
    running batch: the engine steps it beside every other visitor's. lookahead: most events the engine
    may step ahead of this consumer (0: only when asked for the next one, as a race's lockstep laps
    need; None: free). report_wait: also yield `Waiting` events while it waits for KV memory.
    group: any object shared by requests one reader alternates between (a race's laps; Engine.submit).
    Alone (no engine, or on the engine's own thread) it runs here, through the same step code.
    """
    strategy = strategy or Strategy()
    if isinstance(prompt, str):
        prompt = encode_for(backbone, prompt, config)
    row = Row(backbone, prompt, strategy, config, should_stop)
    engine = getattr(backbone, "engine", None)
    if engine is not None and engine.serving():
        yield from engine.submit(row, lookahead=lookahead, report_wait=report_wait, group=group)
        return
    while not row.finished:
        for _, event in advance(backbone, [row]):
            yield event
