"""Prompt-lookup drafts: when the last few tokens occurred before, propose what followed them.

Costs microseconds instead of a forward pass. Summaries, extraction, code edits and QA over a passage
repeat spans of the prompt, so the verifier often accepts several of these tokens at once.
"""
from __future__ import annotations


class PromptLookup:
    """An incremental n-gram index over prompt + output (one per decode call).

    `propose(k)` looks for the longest suffix of n tokens (max_n down to min_n) that occurred earlier
    and returns up to k tokens that followed its most recent earlier occurrence.
    """

    def __init__(self, tokens, max_n: int = 4, min_n: int = 2):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 ≤ min_n ≤ max_n")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}     # n-gram → end index of its latest occurrence
        self.extend(tokens)

    def extend(self, new_tokens) -> None:
        """Append tokens; index every n-gram that ends before the newest token."""
        for t in new_tokens:
            self.tokens.append(int(t))
            end = len(self.tokens) - 1           # index n-grams ending at end-1: their successor exists
            for n in range(self.min_n, self.max_n + 1):
                if end - n >= 0:
                    self.last[tuple(self.tokens[end - n:end])] = end

    def propose(self, k: int) -> tuple[int, ...]:
        """Up to k tokens that followed an earlier occurrence of the current suffix (or nothing)."""
        if k < 1:
            return ()
        toks = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(toks) <= n:
                continue
            start = self.last.get(tuple(toks[-n:]))
            if start is not None:
                return tuple(toks[start:start + k])
        return ()
