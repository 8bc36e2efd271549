"""One forward over many sequences at once: every row's tokens packed into one matrix.

The matmuls (which read the weights: most of a CPU step) run once over all rows' tokens together;
attention runs per row on that row's own KV cache, at its own positions, with its own causal mask.
Rows may carry different numbers of tokens (a 1-token plain step beside a 5-token verification and a
128-token prefill chunk: vLLM's "chunked prefill" shape) and different skip sets: a sublayer runs for
the rows whose set keeps it (their tokens gathered, the result added back), so rows routed to
different domains draft in one pass. One row is exactly `Backbone.forward`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .backbone import EMPTY, Backbone, _rope
from .kv_cache import KVCache
from .skipset import SkipSet


@dataclass
class RowPass:
    """One row of a packed pass: its tokens, its cache (written at cache.length..), its skip set and
    what it wants back: "last" → (vocab,), "all" → (T, vocab), "none" → final-norm hidden (T, D)."""

    ids: list
    cache: KVCache
    skip: SkipSet = EMPTY
    logits: str = "last"


@torch.inference_mode()
def forward_rows(bb: Backbone, rows: list[RowPass], draft=None) -> list[torch.Tensor]:
    """Run every row's tokens in one packed forward; one output per row (as RowPass.logits asks)."""
    if len(rows) == 1:
        r = rows[0]
        return [bb.forward(r.ids, r.cache, r.skip, logits=r.logits, draft=draft)]
    sizes = [len(r.ids) for r in rows]
    starts = [r.cache.length for r in rows]
    for r, n in zip(rows, sizes):
        if r.cache.length + n > r.cache.max_len:
            raise ValueError(f"KV cache full: {r.cache.length + n} > {r.cache.max_len} positions")
    total = sum(sizes)
    ids = torch.tensor([int(t) for r in rows for t in r.ids], dtype=torch.long, device=bb.device)
    pos = torch.cat([torch.arange(p, p + n, device=bb.device) for p, n in zip(starts, sizes)])
    layers, lin = bb._targets[total > 1][:2] if draft is None else (draft.layers, draft.linear)
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    masks = [bb._causal_mask(p, p + n) for p, n in zip(starts, sizes)]
    cos, sin = bb.cos[pos], bb.sin_rot[pos]
    subsets: dict[tuple[int, ...], torch.Tensor | None] = {}
    pads: dict[tuple[int, ...], _Padded] = {}     # one padded buffer per set of rows attending together

    def keeping(kind: str, i: int) -> tuple[int, ...]:
        return tuple(j for j, r in enumerate(rows) if i not in (r.skip.attn if kind == "attn" else r.skip.mlp))

    def index(members: tuple[int, ...]):
        """Token indices of these rows in the packed matrix (None: every row)."""
        if members not in subsets:
            subsets[members] = None if len(members) == len(rows) else torch.cat(
                [torch.arange(offsets[j], offsets[j + 1], device=bb.device) for j in members])
        return subsets[members]

    x = bb.embed[ids]
    for i, L in enumerate(layers):
        members = keeping("attn", i)
        if members:
            at = index(members)
            xs = x if at is None else x[at]
            c, s = (cos, sin) if at is None else (cos[at], sin[at])
            delta = _attention_rows(bb, xs, L, lin, [rows[j] for j in members], [sizes[j] for j in members],
                                    [starts[j] for j in members], [masks[j] for j in members], i, c, s,
                                    pads.setdefault(members, _Padded(bb)))
            x = x + delta if at is None else x.index_add(0, at, delta)
        members = keeping("mlp", i)
        if members:
            at = index(members)
            delta = bb._mlp(x if at is None else x[at], L, lin)
            x = x + delta if at is None else x.index_add(0, at, delta)
    for r, n in zip(rows, sizes):
        r.cache.length += n
    h = F.rms_norm(x, (bb.hidden,), bb.norm, bb.eps)
    want = []                          # the packed positions whose logits some row asked for
    for j, r in enumerate(rows):
        if r.logits == "all":
            want.extend(range(offsets[j], offsets[j + 1]))
        elif r.logits == "last":
            want.append(offsets[j + 1] - 1)
    out_logits = None
    if want:
        sel = h[torch.tensor(want, device=bb.device)]
        out_logits = bb.head_logits(sel) if draft is None else draft.head(sel)
    outs, k = [], 0
    for j, r in enumerate(rows):
        if r.logits == "none":
            outs.append(h[offsets[j]:offsets[j + 1]])
        elif r.logits == "last":
            outs.append(out_logits[k])
            k += 1
        else:
            outs.append(out_logits[k:k + sizes[j]])
            k += sizes[j]
    return outs


BATCHED_SINGLES = 4     # one-token rows in a pass from which their attention runs as one padded call


def _attention_rows(bb: Backbone, x, L, lin, rows, sizes, starts, masks, i, cos, sin, pad):
    """One attention sublayer over packed rows: projections packed, each row's keys and values written to
    its own cache. Rows with several tokens attend one by one; one-token rows (decode steps), when there
    are BATCHED_SINGLES or more, attend in one call over their caches copied into a zero-padded buffer
    (`pad`, made once per pass), masked past each row's length: one call instead of one per row."""
    T = x.shape[0]
    H, Hk, hd, g = bb.n_heads, bb.n_kv, bb.head_dim, bb.group
    qkv = lin(F.rms_norm(x, (bb.hidden,), L.ln1, bb.eps), L.wqkv, L.bqkv)
    qk = _rope(qkv[:, :bb.q_size + bb.kv_size].view(T, H + Hk, hd).transpose(0, 1), cos, sin)
    v_all = qkv[:, bb.q_size + bb.kv_size:].view(T, Hk, hd).transpose(0, 1)
    singles = [j for j, n in enumerate(sizes) if n == 1] if len(sizes) >= BATCHED_SINGLES else []
    if len(singles) < BATCHED_SINGLES:
        singles = []
    pooled = pad.pool(rows, singles) if singles else None
    outs, a, at = [None] * len(rows), 0, []
    for j, (r, n, p0, mask) in enumerate(zip(rows, sizes, starts, masks)):
        b, end = a + n, p0 + n
        if n == 1 and singles:
            at.append(a)
            if pooled is None:         # narrow + copy_: a third of the Python cost of slice assignment
                r.cache.k[i].narrow(1, p0, 1).copy_(qk[H:, a:b])
                r.cache.v[i].narrow(1, p0, 1).copy_(v_all[:, a:b])
            a = b
            continue
        cache = r.cache
        cache.k[i].narrow(1, p0, n).copy_(qk[H:, a:b])
        cache.v[i].narrow(1, p0, n).copy_(v_all[:, a:b])
        o = F.scaled_dot_product_attention(qk[:H, a:b].reshape(1, Hk, g * n, hd), cache.k[i, :, :end][None],
                                           cache.v[i, :, :end][None], attn_mask=mask)
        outs[j] = o.view(H, n, hd).transpose(0, 1).reshape(n, H * hd)
        a = b
    if singles and pooled is not None:   # one indexed write and a view (or one gather) of their slots
        pool, slots, positions, span, valid = pooled
        pool.k[i][slots, :, positions] = qk[H:, at].transpose(0, 1)
        pool.v[i][slots, :, positions] = v_all[:, at].transpose(0, 1)
        keys, values = (pool.k[i, span[0]:span[1], :, :span[2]], pool.v[i, span[0]:span[1], :, :span[2]]) \
            if span[0] is not None else (pool.k[i, :, :, :span[2]].index_select(0, slots),
                                         pool.v[i, :, :, :span[2]].index_select(0, slots))
    elif singles:
        keys, values, valid = pad(rows, singles, starts)
        for b, j in enumerate(singles):
            end = starts[j] + 1
            keys[b].narrow(1, 0, end).copy_(rows[j].cache.k[i].narrow(1, 0, end))
            values[b].narrow(1, 0, end).copy_(rows[j].cache.v[i].narrow(1, 0, end))
    if singles:
        q = qk[:H, at].transpose(0, 1).reshape(len(singles), Hk, g, hd)
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=valid).reshape(len(singles), H * hd)
        for b, j in enumerate(singles):
            outs[j] = o[b:b + 1]
    return lin(torch.cat(outs) if len(outs) > 1 else outs[0], L.wo)


class _Padded:
    """The zero-padded key/value buffer of a pass's one-token rows, made at the first layer that needs it."""

    def __init__(self, bb: Backbone):
        self.bb, self.made, self.pooled = bb, None, False

    def pool(self, rows, singles):
        """When every one-token row's cache is a slot of one KVPool: (pool, slot index, write positions,
        (first slot or None, end slot, keys to read), padding mask), worked out once per pass; else None."""
        if self.pooled is not False:
            return self.pooled
        caches = [rows[j].cache for j in singles]
        pool = caches[0].pool
        self.pooled = None
        if pool is None or any(c.pool is not pool for c in caches):
            return None
        bb = self.bb
        slots = [c.slot for c in caches]
        lengths = [c.length + 1 for c in caches]          # after this pass's token
        upto = max(lengths)
        pool.pad(slots, lengths, upto)
        lo = slots[0]
        span = (lo if slots == list(range(lo, lo + len(slots))) else None, lo + len(slots), upto)
        lengths_t = torch.tensor(lengths, device=bb.device)
        valid = (torch.arange(upto, device=bb.device)[None, :] < lengths_t[:, None])[:, None, None, :]
        self.pooled = (pool, torch.tensor(slots, device=bb.device), lengths_t - 1, span, valid)
        return self.pooled

    def __call__(self, rows, singles, starts):
        if self.made is None:
            bb = self.bb
            n = max(starts[j] for j in singles) + 1
            shape = (len(singles), bb.n_kv, n, bb.head_dim)
            lengths = torch.tensor([starts[j] + 1 for j in singles], device=bb.device)
            valid = (torch.arange(n, device=bb.device)[None, :] < lengths[:, None])[:, None, None, :]
            self.made = (torch.zeros(shape, dtype=bb.dtype, device=bb.device),
                         torch.zeros(shape, dtype=bb.dtype, device=bb.device), valid)
        return self.made
