"""The preallocated KV cache: keys and values of every layer, cut back to an absolute length in O(1)."""
from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys/values for every layer; `length` positions are valid."""

    def __init__(self, n_layers: int, n_kv: int, max_len: int, head_dim: int, dtype, device=None):
        self.k = torch.zeros(n_layers, n_kv, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n_layers, n_kv, max_len, head_dim, dtype=dtype, device=device)
        self.length = 0
        self.max_len = max_len

    def crop(self, length: int) -> None:
        """Cut back every layer to an absolute length (positions past it are dead)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of length {self.length} to {length}")
        self.length = length
