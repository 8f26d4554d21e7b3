"""The one thing Cactus changes in vLLM's rejection step: the target rows.

Every rule of the registry whose drafts are verified against a target ``h`` (core/acceptance.py's
``TargetRule``: SpS, cactus, cactus-exact with any divergence, interp) is standard speculative
sampling with the verifier's ``q`` replaced by ``h``: accept draft ``n`` when ``u * p_n < h_n``, on
rejection draw from ``norm(max(h - p, 0))``; the position then emits exactly the rule's emitted
distribution. vLLM's kernels do exactly that with ``q``; given ``log h`` as the target logits of a
sampled row, they do it with ``h``. So the plugin rewrites those rows, after vLLM's temperature,
top-k and top-p and before its kernels, and nothing else: greedy rows, bonus tokens, logprobs and
the random numbers are vLLM's own.

    spec = RowRule.of({"rule": "cactus", "delta": 1.0})       # a request's extra_args (or the default)
    logits = transform(target_logits, draft_ids, draft_probs, per_token_specs)

``draft_probs`` None: greedy drafts (vLLM's default, n-gram, suffix, EAGLE): ``p`` is one-hot at the
drafted token, as vLLM's kernels take it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cactus_cli.core.acceptance import RULES, TargetRule, resolve_params

FIELDS = (
    "rule",
    "delta",
    "divergence",
    "alpha",
)  # the extra_args keys read (the rules' parameters, as serve takes them)


@dataclass(frozen=True)
class RowRule:
    """One request's rule and its resolved parameters (hashable: rows are grouped by it)."""

    rule: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def identity(self) -> bool:
        """Leaves q as it is (SpS, or Cactus at delta 0): the row is not touched."""
        rule = RULES[self.rule]
        return rule.lossless or rule.budget_bound(dict(self.params)) == 0

    @classmethod
    def of(cls, extra: dict[str, Any] | None, default: RowRule | None = None) -> RowRule:
        """The rule a request asks for in ``extra`` (its ``SamplingParams.extra_args``: ``rule`` and
        the rule's parameters, e.g. ``delta``), over ``default`` (the engine's): parameters without
        a rule go to the default's rule where it takes them, else to Cactus (``{"delta": 0.5}``).
        Raises ValueError with one line naming the field."""
        extra = {k: v for k, v in (extra or {}).items() if k in FIELDS}
        base = default or cls("sps")
        if not extra:
            return base
        if "rule" in extra:
            rule = extra.pop("rule")
        elif set(extra) <= set(RULES[base.rule].param_names()):
            rule = base.rule
        else:  # (a delta alone, over a default that takes none: Cactus at that delta)
            rule = "cactus"
        if not isinstance(rule, str) or rule not in RULES:
            raise ValueError(f"extra_args.rule: unknown acceptance rule {rule!r}; choose one of: {', '.join(RULES)}")
        if not isinstance(RULES[rule], TargetRule):
            raise ValueError(
                f"extra_args.rule: {rule!r} does not verify against a target distribution h, which vLLM's "
                f"rejection step needs; choose one of: {', '.join(TARGET_RULES)}"
            )
        inherited = dict(base.params) if rule == base.rule else {}
        takes = RULES[rule].param_names()
        given = {**{k: v for k, v in inherited.items() if k in takes}, **extra}
        stray = [k for k in given if k not in takes]
        if stray:
            raise ValueError(
                f"extra_args.{stray[0]}: rule {rule!r} takes no {stray[0]!r} (it takes: {', '.join(takes) or 'nothing'})"
            )
        try:
            prm = resolve_params(rule, given)
        except ValueError as err:
            field = next((k for k in given if f"{k!r}" in str(err)), "rule")
            raise ValueError(f"extra_args.{field}: {err}") from None
        return cls(rule, tuple(sorted(prm.items())))


TARGET_RULES = tuple(name for name, r in RULES.items() if isinstance(r, TargetRule))


def transform(
    target_logits: torch.Tensor,  # [T, V] float32, after temperature / top-k / top-p (-inf outside)
    draft_ids: torch.Tensor,  # [T] the drafted token at each position
    draft_probs: torch.Tensor | None,  # [T, V] the draft's distribution, None: one-hot at draft_ids
    specs: list[RowRule | None],  # [T] each position's rule; None: leave the row (greedy, SpS)
    spent: torch.Tensor | None = None,  # [T] float, filled with KL(h || q) of each changed row (0 elsewhere)
) -> torch.Tensor:
    """``target_logits`` with every row whose rule is not the identity replaced by ``log h``
    (``-inf`` where h is 0), rows grouped by rule so each rule runs once, batched. A new tensor;
    the input is not written. ``spent``: where to write the divergence each changed row's target
    takes from the verifier, the budget a token drawn against it spends (the ledger, plugin.py)."""
    if spent is not None:
        spent.zero_()
    groups: dict[RowRule, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec is not None and not spec.identity:
            groups.setdefault(spec, []).append(i)
    if not groups:
        return target_logits
    out = target_logits.clone()
    dtype = torch.float64 if target_logits.dtype == torch.float64 else torch.float32  # (vLLM's rows: float32)
    for spec, rows in groups.items():
        idx = torch.tensor(rows, device=target_logits.device)
        q = torch.softmax(target_logits[idx].to(dtype), dim=-1)  # [R, V]
        n = draft_ids[idx].long()  # [R]
        p = draft_probs[idx].to(dtype) if draft_probs is not None else torch.zeros_like(q).scatter_(-1, n[:, None], 1.0)
        h = RULES[spec.rule].target(dict(spec.params), p[:, None], q[:, None], n[:, None])[:, 0]  # [R, V]
        h = h.clamp(min=0.0)
        log_h = torch.where(h > 0, torch.log(h), torch.full_like(h, float("-inf")))
        out[idx] = log_h.to(out.dtype)
        if spent is not None:
            terms = torch.where(h > 0, h * (log_h - torch.log(q)), torch.zeros_like(h))
            spent[idx] = terms.sum(-1).clamp(min=0.0).to(spent.dtype)
    return out
