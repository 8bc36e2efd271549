"""KNN-SSD router: embed a prompt, find its nearest domain anchors, draft with that domain's set.

Anchors are every calibration prompt plus a few spherical k-means centroids per domain
(arXiv 2505.16162 clusters each domain; keeping the prompts too lets a query that sits near
one unusual calibration prompt still find it). Similarity is cosine: vectors are
L2-normalised and searched with an exact inner-product index, which for a few hundred
anchors costs well under a millisecond. A router built with `centre=True` also subtracts the mean of
its unit-length calibration embeddings (anchors and queries alike) before normalising: the direction
every prompt shares then no longer dominates the cosine (routing/#31, docs/routing.md).
"""
from __future__ import annotations

import copy
import math

import faiss
import numpy as np

from ..engine.skipset import SkipSet
from ..engine.strategy import Neighbour, Route

VOTES = ("majority", "weighted")
KINDS = ("prompt", "centroid")
POINTS_PER_CENTROID = 3     # below this a centroid is little more than a copy of one prompt
KMEANS_ITERATIONS = 20
THRESHOLD_PERCENTILE = 2.0  # suggest_threshold: share (in %) of held-out prompts allowed below it
THRESHOLD_MARGIN = 0.02


def _normalise(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (in float64, so re-normalising a saved table is a no-op)."""
    v = np.asarray(vectors, dtype=np.float64)
    if not np.all(np.isfinite(v)):
        raise ValueError("router vectors contain NaN or infinite values")
    norms = np.linalg.norm(v, axis=-1, keepdims=True)
    if np.any(norms == 0):
        raise ValueError("router vectors must be non-zero (a zero vector has no direction)")
    return np.ascontiguousarray(v / norms, dtype=np.float32)


def _as_query(embedding, dim: int, center: np.ndarray | None = None) -> np.ndarray:
    """A (1, D) float32 unit vector from a torch tensor or numpy array of D values
    (with `center`: the unit vector, minus center, normalised again)."""
    if hasattr(embedding, "detach"):
        embedding = embedding.detach().float().cpu().numpy()
    q = np.asarray(embedding, dtype=np.float64).reshape(-1)
    if q.shape[0] != dim:
        raise ValueError(f"embedding has {q.shape[0]} values but the router's anchors have {dim}; "
                         "was the router calibrated for another model?")
    if not np.all(np.isfinite(q)):
        raise ValueError("embedding contains NaN or infinite values")
    norm = np.linalg.norm(q)
    # a zero query has no direction: similarity 0 to everything, so it lands as unknown
    q = q / norm if norm > 0 else q
    if center is not None and norm > 0:
        q = q - center
        norm = np.linalg.norm(q)
        q = q / norm if norm > 0 else q
    return q.astype(np.float32)[None, :]


def _check_settings(k, vote, threshold) -> None:
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k (neighbours) must be an integer ≥ 1, got {k!r}")
    if vote not in VOTES:
        raise ValueError(f"vote must be one of {VOTES}, got {vote!r}")
    if not isinstance(threshold, (int, float)) or not math.isfinite(threshold) or \
            not -1.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be a cosine similarity in [-1, 1], got {threshold!r}")


def _tally(neighbours: tuple[Neighbour, ...], vote: str) -> dict[str, float]:
    votes: dict[str, float] = {}
    for n in neighbours:
        votes[n.domain] = votes.get(n.domain, 0.0) + (1.0 if vote == "majority" else n.similarity)
    return votes


def _winner(votes: dict[str, float], neighbours: tuple[Neighbour, ...]) -> str:
    """Most votes; ties go to the domain with the nearer best anchor, then by name (stable)."""
    best = {}
    for n in neighbours:
        best.setdefault(n.domain, n.similarity)   # neighbours are best first
    return min(votes, key=lambda d: (-votes[d], -best[d], d))


class Router:
    """Nearest-anchor routing of prompt embeddings to per-domain skip sets."""

    def __init__(self, vectors: np.ndarray, domains: list[str], texts: list[str], kinds: list[str],
                 domain_sets: dict[str, SkipSet], fallback: SkipSet, k: int = 5,
                 vote: str = "weighted", threshold: float = 0.5, center: np.ndarray | None = None):
        """vectors: the anchors, already centred if `center` (D,) is given (queries get it subtracted)."""
        vectors = np.asarray(vectors)
        if vectors.ndim != 2 or vectors.shape[0] == 0:
            raise ValueError(f"router vectors must be a non-empty (N, D) array, got {vectors.shape}")
        n = vectors.shape[0]
        if not len(domains) == len(texts) == len(kinds) == n:
            raise ValueError(f"{n} vectors but {len(domains)} domains, {len(texts)} texts, "
                             f"{len(kinds)} kinds")
        if set(kinds) - set(KINDS):
            raise ValueError(f"anchor kinds must be {KINDS}, got {sorted(set(kinds) - set(KINDS))}")
        missing = sorted(set(domains) - set(domain_sets))
        if missing:
            raise ValueError(f"no skip set for anchor domains {missing}")
        _check_settings(k, vote, threshold)
        self.vectors = _normalise(vectors)
        if center is not None:
            center = np.asarray(center, dtype=np.float64).reshape(-1)
            if center.shape != (self.vectors.shape[1],) or not np.all(np.isfinite(center)):
                raise ValueError(f"router center must be {self.vectors.shape[1]} finite values")
        self.center = center
        self.domains, self.texts, self.kinds = list(domains), list(texts), list(kinds)
        self.domain_sets, self.fallback = dict(domain_sets), fallback
        self.k, self.vote, self.threshold = int(k), vote, float(threshold)
        self.index = faiss.IndexFlatIP(self.dim)
        self.index.add(self.vectors)

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]

    def __len__(self) -> int:
        return self.vectors.shape[0]

    # --- building ---------------------------------------------------------------------------
    @classmethod
    def build(cls, embeddings: dict[str, np.ndarray], texts: dict[str, list[str]],
              domain_sets: dict[str, SkipSet], fallback: SkipSet, centroids_per_domain: int = 4,
              seed: int = 0, centre: bool = False, **kw) -> "Router":
        """Anchors: per domain, its k-means centroids then each calibration prompt (dict order).

        centre: subtract the mean of all the unit-length calibration embeddings first (stored as the
        router's `center`, which every query has subtracted too)."""
        rows, domains, anchor_texts, kinds = [], [], [], []
        center = None
        if centre and embeddings:
            units = np.concatenate([_normalise(np.atleast_2d(v)) for v in embeddings.values()])
            center = units.astype(np.float64).mean(0)
        for domain, vecs in embeddings.items():
            vecs = _normalise(np.atleast_2d(vecs))
            if center is not None:
                vecs = _normalise(vecs - center)
            prompts = list(texts.get(domain, []))
            if len(prompts) != len(vecs):
                raise ValueError(f"domain {domain!r}: {len(vecs)} embeddings but {len(prompts)} texts")
            centroids = _centroids(vecs, centroids_per_domain, seed)
            rows += [centroids, vecs]
            domains += [domain] * (len(centroids) + len(vecs))
            anchor_texts += [""] * len(centroids) + prompts
            kinds += ["centroid"] * len(centroids) + ["prompt"] * len(vecs)
        if not domains:
            raise ValueError("cannot build a router without embeddings")
        return cls(np.concatenate(rows), domains, anchor_texts, kinds, domain_sets, fallback, center=center, **kw)

    # --- routing ----------------------------------------------------------------------------
    def route(self, embedding, k: int | None = None, vote: str | None = None,
              threshold: float | None = None) -> Route:
        k = self.k if k is None else k
        vote = self.vote if vote is None else vote
        threshold = self.threshold if threshold is None else threshold
        _check_settings(k, vote, threshold)
        neighbours = self._nearest(self.query(embedding), min(int(k), len(self)))
        votes = _tally(neighbours, vote)
        best = neighbours[0].similarity
        if best < threshold:
            return Route(None, votes, neighbours, best, self.fallback, True, vote, float(threshold))
        domain = _winner(votes, neighbours)
        return Route(domain, votes, neighbours, best, self.domain_sets[domain], False, vote,
                     float(threshold))

    def query(self, embedding) -> np.ndarray:
        """A prompt embedding as the (1, D) unit vector the anchors are compared with (centred if
        the router is); what the domain map, fitted on `vectors`, places too."""
        return _as_query(embedding, self.dim, self.center)

    def _nearest(self, query: np.ndarray, k: int) -> tuple[Neighbour, ...]:
        sims, rows = self.index.search(query, k)
        # order by (similarity desc, row asc) so equal similarities come out the same every time
        hits = sorted(((float(s), int(r)) for s, r in zip(sims[0], rows[0]) if r >= 0),
                      key=lambda h: (-h[0], h[1]))
        return tuple(Neighbour(self.texts[r], self.domains[r], s, self.kinds[r], r) for s, r in hits)

    def nearest_similarities(self, embeddings: np.ndarray) -> np.ndarray:
        """Cosine similarity of each row's nearest anchor (one batched search)."""
        queries = np.concatenate([self.query(e) for e in np.atleast_2d(embeddings)])
        sims, _ = self.index.search(queries, 1)
        return sims[:, 0].astype(np.float64)

    def accuracy(self, embeddings: dict[str, np.ndarray], **route_kw) -> dict[str, float]:
        """Per domain, the share of its (held-out) embeddings routed to it; plus "overall"."""
        shares, right, total = {}, 0, 0
        for domain, vecs in embeddings.items():
            vecs = np.atleast_2d(vecs)
            hits = sum(self.route(v, **route_kw).domain == domain for v in vecs)
            shares[domain] = hits / len(vecs) if len(vecs) else 0.0
            right, total = right + hits, total + len(vecs)
        shares["overall"] = right / total if total else 0.0
        return shares

    # --- persistence and copies -------------------------------------------------------------
    def to_arrays(self) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays for np.savez, JSON-safe metadata); from_arrays rebuilds the same router."""
        meta = {"texts": list(self.texts), "domains": list(self.domains), "kinds": list(self.kinds),
                "k": self.k, "vote": self.vote, "threshold": self.threshold,
                "sets": {d: s.to_dict() for d, s in self.domain_sets.items()},
                "fallback": self.fallback.to_dict(), "centred": self.center is not None}
        arrays = {"vectors": self.vectors.copy()}
        if self.center is not None:
            arrays["center"] = self.center.astype(np.float64)
        return arrays, meta

    @classmethod
    def from_arrays(cls, arrays, meta: dict) -> "Router":
        try:
            sets = {d: SkipSet.from_dict(s) for d, s in meta["sets"].items()}
            return cls(np.asarray(arrays["vectors"], dtype=np.float32), meta["domains"],
                       meta["texts"], meta["kinds"], sets, SkipSet.from_dict(meta["fallback"]),
                       k=meta["k"], vote=meta["vote"], threshold=meta["threshold"],
                       center=arrays["center"] if meta.get("centred") else None)
        except KeyError as e:
            raise ValueError(f"router artefact is missing {e}") from None

    def with_settings(self, k: int | None = None, vote: str | None = None,
                      threshold: float | None = None) -> "Router":
        """A copy with other defaults; it shares the (read-only) anchor table and index."""
        k = self.k if k is None else k
        vote = self.vote if vote is None else vote
        threshold = self.threshold if threshold is None else threshold
        _check_settings(k, vote, threshold)
        other = copy.copy(self)
        other.k, other.vote, other.threshold = int(k), vote, float(threshold)
        return other


def _centroids(vecs: np.ndarray, wanted: int, seed: int) -> np.ndarray:
    """Up to `wanted` spherical k-means centroids of unit rows (fewer for small domains)."""
    n = min(int(wanted), len(vecs) // POINTS_PER_CENTROID)
    if n <= 0:
        return np.zeros((0, vecs.shape[1]), dtype=np.float32)
    if n == 1:                     # the spherical 1-means solution, without k-means' start-up
        return _normalise(vecs.mean(0, keepdims=True))
    # min_points_per_centroid=1: small calibration sets are expected, faiss's warning is noise
    km = faiss.Kmeans(vecs.shape[1], n, niter=KMEANS_ITERATIONS, seed=int(seed), spherical=True,
                      min_points_per_centroid=1, verbose=False)
    km.train(vecs)
    return _normalise(km.centroids)


def suggest_threshold(router: Router, embeddings_by_domain: dict[str, np.ndarray],
                      percentile: float = THRESHOLD_PERCENTILE,
                      margin: float = THRESHOLD_MARGIN) -> float:
    """A similarity threshold under which a prompt counts as "unknown domain".

    Takes the `percentile`-th percentile of the held-out prompts' nearest-anchor similarities
    and subtracts `margin`, so real in-domain prompts (which the router never saw as anchors)
    are almost never called unknown, while prompts far from every domain still are.
    Use held-out prompts: a calibration prompt is its own anchor (similarity 1).
    """
    vecs = [np.atleast_2d(v) for v in embeddings_by_domain.values() if len(v)]
    if not vecs:
        raise ValueError("suggest_threshold needs at least one held-out embedding")
    sims = router.nearest_similarities(np.concatenate(vecs))
    return float(np.clip(np.percentile(sims, percentile) - margin, -1.0, 1.0))
