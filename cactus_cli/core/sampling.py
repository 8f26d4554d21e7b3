"""Logits -> probabilities (logit bias, temperature, top-k, top-p, min-p), applied identically to
draft and verifier, and a fast exact sampler for one token per row of a [B, V] distribution. Each
step is a per-row transform of the verifier's logits, so the rules target the warped ``q`` and
stay exact whatever the draft does."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cactus_cli.core import defaults


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = defaults.TEMPERATURE  # 0 means greedy
    top_k: int = defaults.TOP_K  # 0 means off
    top_p: float = defaults.TOP_P  # 1 means off
    min_p: float = 0.0  # keep tokens at least min_p times the most likely one's probability; 0 means off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit) pairs, before all else

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after the logit bias, temperature, top-k,
    top-p, then min-p (the order transformers' warpers use). Not for greedy: the engine takes the
    argmax of ``biased`` logits there."""
    V = logits.shape[-1]
    if 0 < sp.top_k < V:
        small, idx = top_probs(logits, sp)  # (biased there)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, idx, small)
    probs = torch.softmax(biased(logits, sp).float() / sp.temperature, -1)
    if sp.top_p < 1.0:
        sorted_probs, idx = probs.sort(-1, descending=True)
        probs = torch.zeros_like(probs).scatter_(-1, idx, _top_p_sorted(sorted_probs, sp.top_p))
    return _min_p(probs, sp.min_p)


def biased(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """[..., V] logits with ``sp.logit_bias`` added (a new tensor; ``logits`` itself without a bias).
    An id past the row's end is skipped (a draft model with fewer rows than the verifier)."""
    V = logits.shape[-1]
    pairs = [(i, b) for i, b in sp.logit_bias if i < V]
    if not pairs:
        return logits
    out = logits.clone()
    ids = torch.tensor([i for i, _ in pairs], device=logits.device)
    out[..., ids] += torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
    return out


def top_probs(logits: torch.Tensor, sp: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """With top-k on: the probabilities of the top-k tokens ([..., top_k] float32, the rest of
    the row is 0) and their ids, sorted descending. Only those values are scaled by T (dividing
    by T > 0 keeps their order)."""
    vals, idx = biased(logits, sp).topk(sp.top_k, dim=-1)  # [..., top_k]
    return _min_p(_top_p_sorted(torch.softmax(vals.float() / sp.temperature, -1), sp.top_p), sp.min_p), idx


def sample_among(probs: torch.Tensor, ids: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One of ``ids`` [n] drawn by ``probs`` [n] (a few nonzero values: top_probs), as ``sample``
    draws from the full row they came from: one uniform, the inverse CDF in float64. [1]."""
    cum = probs.double().cumsum(-1)  # [n]
    u = torch.rand((1,), generator=generator, device=probs.device, dtype=torch.float64)
    i = torch.searchsorted(cum, _below(u * cum[-1:], cum[-1:]), right=True).clamp(max=len(ids) - 1)
    return ids[i]


def _top_p_sorted(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest prefix whose mass reaches top_p (at least one token); renormalize."""
    if top_p >= 1.0:
        return sorted_probs
    before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
    kept = sorted_probs.masked_fill(before >= top_p, 0.0)
    return kept / kept.sum(-1, keepdim=True)


def _min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep the tokens whose probability is at least ``min_p`` times the row's largest (that one
    always); renormalize. [..., n] -> [..., n]."""
    if min_p <= 0.0:
        return probs
    kept = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    return kept / kept.sum(-1, keepdim=True)


_BLOCK = 1024  # two-level inverse-CDF sampling: block sums, then a cumsum inside one block


def sample(dist: torch.Tensor, generator: torch.Generator | None, fallback: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of the unnormalized, non-negative [B, V] ``dist``, by inverse CDF with one
    uniform draw per row. A row with no usable mass (a rounding fluke: the rejection had
    probability ~0) is drawn from ``fallback`` instead (default: uniform); the index is always in [0, V).

    Two levels keep it exact and fast: float32 sums of 1024-token blocks, a float64 cumsum over
    the blocks, then a float64 cumsum inside the chosen block only (a float32 cumsum over 150k
    tokens drifts by ~1e-5; torch.multinomial is several times slower here)."""
    B, V = dist.shape
    block_mass = _block_mass(dist)  # [B, nb]
    total = block_mass.sum(-1, keepdim=True)
    bad = ~(torch.isfinite(total) & (total > 0))  # [B, 1]
    # branch-free (no host sync: drafting can queue ahead on a GPU): the fallback's block sums
    # are computed for every row and used where the row is bad; inside the chosen block too
    fb_mass = _block_mass(torch.ones(1, V, dtype=dist.dtype, device=dist.device) if fallback is None else fallback)
    block_mass = torch.where(bad, fb_mass, block_mass)
    cum_blocks = block_mass.double().cumsum(-1)  # [B, nb]
    u = torch.rand((B, 1), generator=generator, device=dist.device, dtype=torch.float64)
    x = _below(u * cum_blocks[:, -1:], cum_blocks[:, -1:])  # [B, 1], in [0, total)
    b = torch.searchsorted(cum_blocks, x, right=True).clamp(max=cum_blocks.shape[-1] - 1)  # first block past x
    before = torch.where(b > 0, cum_blocks.gather(-1, (b - 1).clamp(min=0)), torch.zeros_like(x))
    cols = b * _BLOCK + torch.arange(_BLOCK, device=dist.device)  # [B, BLOCK]
    picked = dist.gather(-1, cols.clamp(max=V - 1))  # [B, BLOCK]
    fb_picked = torch.ones_like(picked) if fallback is None else fallback.gather(-1, cols.clamp(max=V - 1))
    inner = torch.where(bad, fb_picked, picked).masked_fill(cols >= V, 0.0).double().cumsum(-1)
    xi = _below((x - before).clamp(min=0.0), inner[:, -1:])
    i = torch.searchsorted(inner, xi, right=True)
    return (b * _BLOCK + i).squeeze(-1).clamp(0, V - 1)


def _block_mass(dist: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B, ceil(V / BLOCK)] float32 sums; the tail (V % BLOCK tokens) is a shorter block."""
    B, V = dist.shape
    nf = V // _BLOCK
    full = dist[:, : nf * _BLOCK].view(B, nf, _BLOCK).sum(-1)
    if V % _BLOCK == 0:
        return full
    return torch.cat([full, dist[:, nf * _BLOCK :].sum(-1, keepdim=True)], dim=-1)


def _below(x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    """x clipped strictly below top, so the strict search lands on a token with positive mass."""
    return torch.minimum(x, torch.nextafter(top, torch.zeros_like(top)))
