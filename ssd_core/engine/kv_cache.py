"""The KV cache: keys and values of every layer, cut back to an absolute length in O(1).

A sequence decoded alone owns a preallocated `KVCache`. The serving engine keeps its rows' caches
in one `KVPool`: a slot per row, so that a pass's one-token rows write their new keys in one
indexed copy and attend over their slots as one tensor (packed.forward_rows), instead of one copy
and one call per row.
"""
from __future__ import annotations

import torch


def bytes_per_position(bb) -> int:
    """Bytes one position of a backbone's KV cache takes (keys and values of every layer)."""
    return 2 * bb.n_layers * bb.n_kv * bb.head_dim * bb.embed.element_size()


class KVCache:
    """Keys/values for every layer, (layers, kv heads, positions, head dim); `length` positions are valid."""

    def __init__(self, n_layers: int, n_kv: int, max_len: int, head_dim: int, dtype, device=None):
        self.k = torch.zeros(n_layers, n_kv, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n_layers, n_kv, max_len, head_dim, dtype=dtype, device=device)
        self.length = 0
        self.max_len = max_len
        self.pool, self.slot = None, None

    @classmethod
    def in_pool(cls, pool: "KVPool", slot: int, max_len: int) -> "KVCache":
        """A cache whose keys/values are views of one slot of `pool` (no memory of its own)."""
        self = cls.__new__(cls)
        self.k, self.v = pool.k[:, slot], pool.v[:, slot]
        self.length, self.max_len, self.pool, self.slot = 0, max_len, pool, slot
        return self

    def crop(self, length: int) -> None:
        """Cut back every layer to an absolute length (positions past it are dead)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length


class KVPool:
    """Slots of `slot_len` positions for the engine's rows, zeroed when made (a pass reads other rows'
    padding under a mask, and a masked key still multiplies its value by zero: it must be finite).
    reserve=False: allocated empty instead, pages touched only as rows use them, and a slot's positions
    made finite up to `finite[slot]` (written, or zeroed when a pass first reads them as padding)."""

    def __init__(self, n_layers: int, n_kv: int, slots: int, slot_len: int, head_dim: int, dtype, device=None,
                 reserve: bool = True):
        shape = (n_layers, slots, n_kv, slot_len, head_dim)
        make = torch.zeros if reserve else torch.empty
        self.k = make(shape, dtype=dtype, device=device)
        self.v = make(shape, dtype=dtype, device=device)
        self.slot_len = slot_len
        self.free = list(range(slots))
        self.finite = [slot_len if reserve else 0] * slots

    def take(self, max_len: int) -> KVCache | None:
        """The lowest free slot as a cache of `max_len` positions (None: too long, or no slot free)."""
        if max_len > self.slot_len or not self.free:
            return None
        slot = min(self.free)
        self.free.remove(slot)
        return KVCache.in_pool(self, slot, max_len)

    def give(self, cache: KVCache) -> None:
        self.finite[cache.slot] = max(self.finite[cache.slot], cache.length)
        self.free.append(cache.slot)

    def pad(self, slots: list[int], lengths: list[int], upto: int) -> None:
        """Make positions [length, upto) of each slot finite (zero what was never written)."""
        for s, n in zip(slots, lengths):
            self.finite[s] = max(self.finite[s], n)
            if self.finite[s] < upto:
                self.k[:, s, :, self.finite[s]:upto] = 0.0
                self.v[:, s, :, self.finite[s]:upto] = 0.0
                self.finite[s] = upto
