"""SkipSet: which attention and MLP sublayers the draft pass leaves out.

Skipping a sublayer means its residual branch is not added (h stays h). A set may also skip part of
every MLP it runs: `channels` names a ranking of each layer's MLP channels (the intermediate
neurons, most important first, measured on some prompts: calibration/channels.py) and the draft
keeps the first `keep` share of them in every layer (the draft-weights factory, engine/drafts.py),
the rest are replaced by their mean output.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SkipSet:
    """Layer indices whose attention / MLP sublayer the draft skips."""

    attn: frozenset[int] = field(default_factory=frozenset)
    mlp: frozenset[int] = field(default_factory=frozenset)
    name: str = ""
    channels: str = ""      # the MLP channel ranking the draft keeps the top of ("" → every channel)
    keep: float = 1.0       # share of each MLP's channels kept when `channels` is set

    def __post_init__(self):
        keep = float(self.keep)
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"SkipSet.keep must lie in (0, 1], got {self.keep!r}")
        if keep < 1.0 and not self.channels:
            raise ValueError("SkipSet.keep below 1 needs `channels`, the ranking that says which to keep")
        object.__setattr__(self, "keep", 1.0 if not self.channels else keep)
        for kind in ("attn", "mlp"):
            values = getattr(self, kind)
            if isinstance(values, (str, bytes)):
                raise TypeError(f"SkipSet.{kind} must be a collection of layer indices")
            ints = frozenset(int(v) for v in values)
            if any(isinstance(v, bool) or int(v) != v for v in values):
                raise TypeError(f"SkipSet.{kind} must hold integers, got {sorted(values)!r}")
            object.__setattr__(self, kind, ints)

    @classmethod
    def empty(cls, name: str = "full") -> "SkipSet":
        return cls(frozenset(), frozenset(), name)

    def validate(self, n_layers: int) -> "SkipSet":
        """Raise ValueError if any index is outside [0, n_layers)."""
        for kind in ("attn", "mlp"):
            bad = sorted(i for i in getattr(self, kind) if not 0 <= i < n_layers)
            if bad:
                raise ValueError(
                    f"SkipSet {self.name or '(unnamed)'}: {kind} layer indices {bad} are out of "
                    f"range for a model with {n_layers} layers (valid: 0..{n_layers - 1})"
                )
        return self

    def __len__(self) -> int:
        return len(self.attn) + len(self.mlp)

    @property
    def is_empty(self) -> bool:
        return not self.attn and not self.mlp and not self.channels

    @property
    def channel_key(self) -> tuple[str, float] | None:
        """(ranking, keep) when the draft keeps only part of each MLP, else None."""
        return (self.channels, self.keep) if self.channels else None

    def sublayer_ratio(self, n_layers: int) -> float:
        """Share of the 2·L sublayers that are skipped."""
        return len(self) / (2 * n_layers)

    def weight_ratio(self, attn_params: int, mlp_params: int, n_layers: int,
                     other_params: int = 0) -> float:
        """Share of the model's weights the draft does not read (per decoder layer sizes)."""
        total = n_layers * (attn_params + mlp_params) + other_params
        mlp_skipped = len(self.mlp) + (1.0 - self.keep) * (n_layers - len(self.mlp))
        return (len(self.attn) * attn_params + mlp_skipped * mlp_params) / total

    def same_draft(self, other: "SkipSet | None") -> bool:
        """Whether drafting with `other` is drafting with this set: same sublayers, same MLP channels
        (names aside; channel sets under different rankings count as different)."""
        return other is not None and (self.attn, self.mlp, self.channel_key) == (other.attn, other.mlp,
                                                                                 other.channel_key)

    def words(self) -> str:
        """The set in a few words: "skips attention 13 · MLP 24" (+ "· MLPs keep 50% of channels")."""
        parts = [f"attention {', '.join(map(str, sorted(self.attn)))}" if self.attn else "",
                 f"MLP {', '.join(map(str, sorted(self.mlp)))}" if self.mlp else ""]
        text = "skips " + " · ".join(p for p in parts if p) if self.attn or self.mlp else "skips nothing"
        return text + (f" · MLPs keep {self.keep:.0%} of channels" if self.channels else "")

    def with_name(self, name: str) -> "SkipSet":
        return SkipSet(self.attn, self.mlp, name, self.channels, self.keep)

    def to_dict(self) -> dict:
        d = {"name": self.name, "attn": sorted(self.attn), "mlp": sorted(self.mlp)}
        if self.channels:
            d.update(channels=self.channels, keep=self.keep)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SkipSet":
        unknown = set(d) - {"name", "attn", "mlp", "channels", "keep"}
        if unknown:
            raise ValueError(f"SkipSet: unknown keys {sorted(unknown)}")
        return cls(frozenset(d.get("attn", ())), frozenset(d.get("mlp", ())), d.get("name", ""),
                   d.get("channels", ""), d.get("keep", 1.0))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> "SkipSet":
        return cls.from_dict(json.loads(text))

    def __str__(self) -> str:
        channels = f", {self.keep:.0%} of MLP channels by {self.channels!r}" if self.channels else ""
        return f"SkipSet({self.name or '-'}: attn={sorted(self.attn)}, mlp={sorted(self.mlp)}{channels})"
