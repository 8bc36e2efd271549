"""Spec-Bench's formats: question files in, answer lines out; selection and the order of the stream."""
from __future__ import annotations

import json
import random
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Question:
    question_id: object
    category: str
    prompt: str


def load_questions(path) -> list[Question]:
    """Read a Spec-Bench question file; the first turn is the prompt."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
            out.append(Question(q["question_id"], str(q["category"]), str(q["turns"][0])))
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: expected a Spec-Bench question with question_id, category "
                             f"and turns ({exc})") from exc
    if not out:
        raise ValueError(f"{path} holds no questions")
    return out


def select(questions: list[Question], categories=None, limit: int | None = None) -> list[Question]:
    """Keep the given categories (all if None) and at most `limit` questions per category."""
    if categories:
        wanted = set(categories)
        missing = wanted - {q.category for q in questions}
        if missing:
            raise ValueError(f"no questions in categories {sorted(missing)}")
        questions = [q for q in questions if q.category in wanted]
    if limit is not None:
        seen: Counter = Counter()
        kept = []
        for q in questions:
            if seen[q.category] < limit:
                kept.append(q)
                seen[q.category] += 1
        questions = kept
    return questions


def mix_order(questions: list, ratio: float, seed: int = 0) -> list:
    """Order a question stream like KNN-SSD's task-stream experiment (see stats.DEFINITIONS['mix_ratio'])."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"mix ratio must be in [0, 1], got {ratio}")
    cats = list(dict.fromkeys(q.category for q in questions))
    queues = {c: deque(q for q in questions if q.category == c) for c in cats}
    rng = random.Random(seed)
    out: list = []
    current = cats[0] if cats else None
    while len(out) < len(questions):
        if out:
            at = cats.index(current)
            others = [c for c in cats[at + 1:] + cats[:at] if queues[c]]
            coin = rng.random() < ratio          # drawn every position, so the order is reproducible
            if others and (coin or not queues[current]):
                current = others[0]
        out.append(queues[current].popleft())
    return out


def switch_rate(order: list) -> float:
    """Share of consecutive pairs whose category differs (the realised mix)."""
    if len(order) < 2:
        return 0.0
    return sum(a.category != b.category for a, b in zip(order, order[1:])) / (len(order) - 1)


def load_answers(path) -> list[dict]:
    """The JSON objects of an answer file (`answer_line`'s format), one a line; blank lines skipped."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def answer_line(model: str, r: dict) -> dict:
    """One Spec-Bench answer line from a bench record of one strategy on one question."""
    return {
        "question_id": r["question_id"], "category": r["category"],
        "answer_id": f"{r['strategy']}-{r['question_id']}-{int(r['tstamp'] * 1e6):x}",
        "model_id": f"{model}-{r['strategy']}",
        "choices": [{"index": 0, "turns": [r["text"]], "new_tokens": [r["new_tokens"]],
                     "wall_time": [round(r["wall_s"], 6)], "accept_lengths": [r["accept_lengths"]],
                     "decoding_steps": [r["steps"]]}],
        "tstamp": r["tstamp"],
    }
