"""What one step decides for one request, in the order the step makes it: the ``Decision`` (its
rule's verdict in the making), its part of the step's one host read (``HostRead``), what was
``Verified`` (nothing committed yet), the step's ``Timing``; and each emitted token's log-probability
(``token_logprobs``). request.py makes and reads them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cactus_cli.core.verify import Row, Verdict


@dataclass
class Verified:
    """What the verifier decided about one run's proposal (nothing committed yet)."""

    accepted: int  # m: drafts kept
    new: list[int]  # the m accepted drafts and the correction or bonus token
    drafts: list[int]
    next_input: torch.Tensor  # [1] on the verifier's device: the next step's first input
    p: torch.Tensor | None  # [1, k, V] draft probabilities (None when greedy)
    q: torch.Tensor | None  # [1, k+1, V] verifier probabilities (None when greedy)
    logits: torch.Tensor  # [k+1, V]


@dataclass(frozen=True)
class HostRead:
    """One run's part of the step's one device-to-host copy, packed as one int64 vector:

    [m, tokens[0..k], drafts[0..k-1], nan, nonfinite?]
     1  k+1 (the m accepted, the extra, then -1s)  k  1   1 (sampling only)
    """

    accepted: int
    tokens: list[int]  # [k+1]: the verdict's row
    drafts: list[int]  # [k]
    nan_logits: bool
    nonfinite_probs: bool

    @staticmethod
    def pack(verdict: Verdict, drafts: torch.Tensor, flags: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([verdict.num_accepted[:1], verdict.tokens[0], drafts, torch.stack(flags).to(torch.int64)])

    @classmethod
    def read(cls, host: list[int], k: int) -> HostRead:
        return cls(
            host[0],
            host[1 : k + 2],
            host[k + 2 : 2 * k + 2],
            bool(host[2 * k + 2]),
            len(host) > 2 * k + 3 and bool(host[2 * k + 3]),
        )


@dataclass
class Decision:
    """One run's verdict in the making: its error flags and drafts, and the verdict (set by the
    step's ``verify_rows`` where the run's rule decides: ``row``)."""

    flags: list[torch.Tensor]
    drafts: torch.Tensor  # [k]
    logits: torch.Tensor  # [k+1, V]
    verdict: Verdict | None
    row: Row | None = None
    p: torch.Tensor | None = None  # [1, k, V] (the meter's)
    q: torch.Tensor | None = None  # [1, k+1, V]

    def packed(self) -> torch.Tensor:
        return HostRead.pack(self.verdict, self.drafts, self.flags)


@dataclass(frozen=True)
class Timing:
    draft_seconds: float
    verify_seconds: float
    forward_seconds: float = 0.0  # of verify_seconds, the verifier's model call


def token_logprobs(logits: torch.Tensor, emitted: list[int], top: int) -> tuple:
    """Each emitted token's log-probability under the verifier's raw distribution (its logits at
    temperature 1, nothing truncated, as vLLM reports them), and the ``top`` most likely tokens
    there: emitted token i was decided at row i of the verify block, drafted or not. One host
    read, only when asked."""
    n = len(emitted)
    lp = torch.log_softmax(logits[:n].float(), -1)  # [n, V]
    chosen = lp.gather(1, torch.tensor(emitted, device=lp.device).view(n, 1)).view(n).tolist()
    if top:
        values, ids = lp.topk(top, -1)  # (a grammar's mask may leave fewer than ``top``: the -inf ones are left out)
        alts = [
            tuple((t, x) for t, x in zip(i, v) if x != float("-inf")) for i, v in zip(ids.tolist(), values.tolist())
        ]
    else:
        alts = [()] * n
    return tuple(zip(chosen, alts))
