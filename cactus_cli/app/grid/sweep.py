"""The one grid sweep (bench, eval and calibrate; no Rich here): rules x delta x k per engine
variant, the verifier-alone baseline on the same prompts, sampling and seeds, optionally Hugging
Face assisted generation; its --json / CSV documents. It takes parsed lists (app/config/settings.py
parses what users type)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from cactus_cli.app.config.parsing import parse_list
from cactus_cli.app.config.settings import check_each
from cactus_cli.app.grid.configs import BenchConfig
from cactus_cli.app.prompts import Prompt
from cactus_cli.app.runtime import check_fits, encode
from cactus_cli.core.acceptance import LOSSLESS
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.stats import SpecStats, summarize
from cactus_cli.infer.decode.batch import Batch
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine
from cactus_cli.infer.runner import sync


@dataclass
class ConfigResult:
    config: BenchConfig
    stats: SpecStats
    by_category: dict[str, SpecStats]
    prompts_done: int
    correct: int = 0  # eval: problems answered correctly, out of ``graded``
    graded: int = 0
    answers: list[dict[str, Any]] = field(default_factory=list)  # eval: one per problem
    wall_seconds: float = 0.0  # bench --concurrency N > 1: from the requests' submission to the last answer
    ttfts: list[float] = field(default_factory=list)  # per request: seconds from submission to its first token
    request_rates: list[float] = field(default_factory=list)  # per request: its decode tokens per second

    def metrics(self, stats: SpecStats | None = None) -> dict[str, Any]:
        s = stats or self.stats
        tps = s.tokens_per_second
        kl = summarize(s.realized_kl) if s.realized_kl else {}
        tv = summarize(s.realized_tv) if s.realized_tv else {}
        return {
            "num_output_tokens": s.num_output_tokens,
            "total_seconds": s.total_seconds,
            "tokens_per_second": tps,
            "decode_tokens_per_second": s.decode_tokens_per_second,  # (after each prompt's prefill)
            "ms_per_output_token": 1000 / tps if tps else None,
            "mean_accepted_tokens_per_step": s.mean_accepted_tokens_per_step,
            "mean_acceptance_length": s.mean_acceptance_length,
            "draft_acceptance_rate": s.draft_acceptance_rate,
            "per_token_acceptance": s.per_token_acceptance,
            "acceptance_histogram": list(s.acceptance_histogram),
            "k_histogram": list(s.k_histogram),
            "mean_k": s.mean_k,
            "draft_sources": s.draft_sources,
            "per_position_acceptance_rate": s.per_position_acceptance_rate,
            "verifier_forward_passes_per_token": (
                s.verifier_forward_passes / s.num_output_tokens
                if s.num_output_tokens and self.config.kind != "hf-assisted"
                else None
            ),
            "step_split": s.step_split,
            "time_to_first_token": (
                s.time_to_first_token / max(self.prompts_done, 1) if s.time_to_first_token is not None else None
            ),
            # requests together (bench --concurrency): every answer's tokens over the wall time
            # from the first request submitted to the last answer; each request's own rate; TTFT
            "concurrency": self.config.concurrency,
            "aggregate_tokens_per_second": (s.num_output_tokens / self.wall_seconds if self.wall_seconds else tps),
            "request_decode_tokens_per_second": _mean(self.request_rates),
            "ttft_p50": _quantile(self.ttfts, 0.5),
            "ttft_p90": _quantile(self.ttfts, 0.9),
            # the divergence meter (bench --meter, calibrate): per emitted position
            "realized_kl_mean": kl.get("mean"),
            "realized_kl_p90": kl.get("p90"),
            "realized_kl_max": kl.get("max"),
            # the per-token budget as used: KL(h^(n) || q) of each draft's target, its largest
            "draft_budget_kl_max": max(s.draft_budget) if s.draft_budget else None,
            "realized_tv_mean": tv.get("mean"),
            "mean_verifier_loglik": s.mean_verifier_loglik,
        }

    def add(self, prompt: Prompt, s: SpecStats, verdict: tuple[bool, str | None] | None = None) -> None:
        """One generation (a problem may have several: --samples); its verdict if graded."""
        if self.config.concurrency == 1:  # (requests together: their own clock, run_concurrent)
            if s.time_to_first_token is not None:
                self.ttfts.append(s.time_to_first_token)
            if s.decode_tokens_per_second:
                self.request_rates.append(s.decode_tokens_per_second)
        self.stats.merge(s)
        self.by_category.setdefault(prompt.category, SpecStats()).merge(s)
        self.prompts_done += 1
        if verdict is not None:
            ok, given = verdict
            self.graded += 1
            self.correct += int(ok)
            self.answers.append({"id": prompt.id, "category": prompt.category, "answer": given, "correct": ok})

    def pass_rates(self) -> dict[str, float]:
        """Per problem, the share of its samples graded correct (pass@1, unbiased for n samples)."""
        by: dict[str, list[bool]] = {}
        for a in self.answers:
            by.setdefault(a["id"], []).append(a["correct"])
        return {k: sum(v) / len(v) for k, v in by.items()}


Grade = Callable[[Prompt, list[str]], list[tuple[bool, str | None]]]  # a problem's texts -> (correct, the answer given)
SAMPLE_STRIDE = 1_000_003  # eval --samples: sample s of prompt i is seeded base + i + s * this


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _quantile(values: list[float], q: float) -> float | None:
    """The q-quantile by linear interpolation (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)


def run_one(
    engine: SpeculativeEngine,
    cfg: BenchConfig,
    i: int,
    ids: list[int],
    base: GenerationParams,
    prompt: Prompt | None = None,
    sample: int = 0,
) -> tuple[SpecStats, str]:
    """One configuration on prompt ``i`` (seed = base seed + i, + SAMPLE_STRIDE per further
    sample, so every configuration sees the same seeds): its stats and the text it generated
    (``prompt.stop``: where its answer ends). A multi-turn question (``prompt.turns``, MT-Bench)
    asks each later turn after the model's own answer to the one before, through the chat
    template, the caches keeping the conversation so far; its stats count every turn's tokens
    and time together, as Spec-Bench does (its time to first token is the first turn's), and the
    text is the last answer."""
    stop = prompt.stop if prompt is not None else ()
    stats, text = _turn(engine, cfg, i, ids, base, stop, sample)
    if prompt is None or not prompt.turns:
        return stats, text
    first, answers = stats.time_to_first_token, [text]
    for _ in prompt.turns:
        more, text = _turn(engine, cfg, i, next_turn(engine, prompt, answers), base, stop, sample, reuse=True)
        stats.merge(more)
        answers.append(text)
    stats.time_to_first_token = first
    return stats, text


def _turn(
    engine: SpeculativeEngine,
    cfg: BenchConfig,
    i: int,
    ids: list[int],
    base: GenerationParams,
    stop: tuple[str, ...],
    sample: int,
    reuse: bool = False,
) -> tuple[SpecStats, str]:
    if cfg.kind == "hf-assisted":
        return _one_hf(engine, cfg, i, ids, base)
    s, text = SpecStats(), []
    for ev in engine.generate(ids, _params(cfg, base, i, stop, sample), reuse_cache=reuse):
        s.update(ev)
        text.append(ev.text)
    return s, "".join(text)


def next_turn(engine: SpeculativeEngine, prompt: Prompt, answers: list[str]) -> list[int]:
    """The token ids of ``prompt``'s next user turn after the model's ``answers`` (with or without
    the chat template, as its first turn was encoded), checked to fit the context window."""
    ids = encode(engine.pair.tokenizer, prompt.conversation(answers), prompt.chat)
    what = f"turn {len(answers) + 1} of question {prompt.id!r} is {len(ids)} tokens with the answers before it,"
    check_fits(engine, prompt, ids, what, "lower --max-tokens or shorten it")
    return ids


def longest_prompt(tokenizer: Any, encoded: list[tuple[Prompt, list[int]]], max_tokens: int) -> int:
    """The most prompt tokens a run will hold: a multi-turn question's last turn counts its
    turns with an answer of ``max_tokens`` before each (empty answers, plus those tokens)."""
    longest = 0
    for prompt, ids in encoded:
        if prompt.turns:
            empty = encode(tokenizer, prompt.conversation([""] * len(prompt.turns)), prompt.chat)
            longest = max(longest, len(empty) + max_tokens * len(prompt.turns))
        longest = max(longest, len(ids))
    return longest


def _params(cfg: BenchConfig, base: GenerationParams, i: int, stop: tuple[str, ...], sample: int = 0):
    return dataclasses.replace(
        base,
        rule=cfg.rule or LOSSLESS,
        rule_kwargs=cfg.rule_kwargs,
        num_draft_tokens=cfg.k,
        adaptive_k=cfg.adaptive,
        ignore_eos=False,
        seed=base.seed + i + sample * SAMPLE_STRIDE,
        stop=base.stop + tuple(stop),
        memory=cfg.label,
    )  # (a drafter with memory learns from this row's own answers only: labels are unique, build_grid)


@dataclass
class _Asked:
    """A question in flight (bench --concurrency): the turns it finished, the one it is on."""

    prompt: Prompt
    i: int
    slot: int
    stats: SpecStats = field(default_factory=SpecStats)  # the turns finished, together
    turn: SpecStats = field(default_factory=SpecStats)
    text: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    first: float | None = None  # seconds from the submission to its first token


def run_concurrent(
    engine: SpeculativeEngine,
    result: ConfigResult,
    prompts: list[tuple[Prompt, list[int]]],
    base: GenerationParams,
    on_run: Callable[[BenchConfig], None],
) -> None:
    """``result``'s configuration over every prompt as a server with ``concurrency`` slots serves
    them: all submitted together, ``concurrency`` stepped in one batch (continuous batching: the
    next prompt joins when one finishes), each with the seed it has alone. Each request's time to
    first token counts from the submission. A multi-turn question keeps its slot: its next turn
    joins when its answer ends (``run_one``)."""
    cfg = result.config
    batch = Batch(engine)
    waiting = list(enumerate(prompts))
    live: dict[Any, _Asked] = {}
    t0 = time.perf_counter()
    try:
        while waiting or live:
            while waiting and len(live) < cfg.concurrency:
                i, (prompt, ids) = waiting.pop(0)
                used = {q.slot for q in live.values()}
                slot = next(s for s in range(len(engine.slots)) if s not in used)
                req = batch.add(engine.start(ids, _params(cfg, base, i, prompt.stop), slot=slot))
                live[req] = _Asked(prompt, i, slot)
            for req, ev in batch.step():
                if isinstance(ev, BaseException):
                    raise ev
                q = live[req]
                q.turn.update(ev)
                q.text.append(ev.text)
                if q.first is None and ev.emitted:
                    q.first = time.perf_counter() - t0
                if not req.done:
                    continue
                del live[req]
                first_ttft = q.stats.time_to_first_token if q.answers else q.turn.time_to_first_token
                q.stats.merge(q.turn)
                q.stats.time_to_first_token = first_ttft
                q.answers.append("".join(q.text))
                if len(q.answers) <= len(q.prompt.turns):  # its next turn, in the same slot and caches
                    q.turn, q.text = SpecStats(), []
                    run = engine.start(
                        next_turn(engine, q.prompt, q.answers), _params(cfg, base, q.i, q.prompt.stop), slot=q.slot
                    )
                    live[batch.add(run, reuse=True)] = q
                    continue
                result.ttfts.append(q.first if q.first is not None else time.perf_counter() - t0)
                if q.stats.decode_tokens_per_second:
                    result.request_rates.append(q.stats.decode_tokens_per_second)
                result.add(q.prompt, q.stats)
                on_run(cfg)
    finally:
        for req in list(live):
            batch.cancel(req)
        result.wall_seconds += time.perf_counter() - t0


def run_speculative(
    engine: SpeculativeEngine,
    cfg: BenchConfig,
    prompts: list[tuple[Prompt, list[int]]],
    base: GenerationParams,
    on_prompt: Callable[[], None],
    sink: list[ConfigResult],
    grade: Grade | None = None,
) -> None:
    """Run one configuration over every prompt (graded, with ``grade``). The result goes into
    ``sink`` before the first prompt, so an interrupted run keeps the prompts that finished."""
    result = ConfigResult(cfg, SpecStats(), {}, 0)
    sink.append(result)
    for i, (prompt, ids) in enumerate(prompts):
        stats, text = run_one(engine, cfg, i, ids, base, prompt)
        result.add(prompt, stats, grade(prompt, [text])[0] if grade is not None else None)
        on_prompt()


@dataclass
class Generated:
    """One generation of one configuration on one problem (what eval --resume keeps)."""

    label: str
    stats: SpecStats
    text: str
    verdict: tuple[bool, str | None] | None = None


def run_grid(
    engines: dict[Any, SpeculativeEngine],
    grid: list[BenchConfig],
    prompts: list[tuple[Prompt, list[int]]],
    base: GenerationParams,
    on_run: Callable[[BenchConfig], None],
    sink: list[ConfigResult],
    grade: Grade | None = None,
    samples: int = 1,
    done: dict[str, list[Generated]] | None = None,
    on_problem: Callable[[Prompt, list[Generated]], None] | None = None,
) -> None:
    """Every configuration on every prompt, prompt by prompt (all configurations on prompt 1, then
    prompt 2, ...): a machine that speeds up or slows down during a long run (another tenant,
    heat) then moves every row alike instead of favouring whichever ran in its fast minutes.
    Results go into ``sink`` first, so an interrupted run keeps what finished. ``engines`` maps
    each configuration's ``variant`` to the engine that runs it. With ``grade`` (eval), a
    problem's texts (``samples`` per configuration) are graded together once they are all
    generated, outside the timed region (code checks run in parallel). ``done`` (eval
    --resume): problems finished in an earlier sitting, taken as they were; ``on_problem``
    hears of each problem finished now."""
    results = [ConfigResult(cfg, SpecStats(), {}, 0) for cfg in grid]
    sink.extend(results)
    by_label = {r.config.label: r for r in results}
    together = [r for r in results if r.config.concurrency > 1]
    results = [r for r in results if r.config.concurrency == 1]
    for i, (prompt, ids) in enumerate(prompts):
        if done and prompt.id in done:
            for g in done[prompt.id]:
                by_label[g.label].add(prompt, g.stats, g.verdict)
            continue
        made: list[tuple[ConfigResult, Generated]] = []
        for result in results:
            for sample in range(samples):
                stats, text = run_one(engines[result.config.variant], result.config, i, ids, base, prompt, sample)
                made.append((result, Generated(result.config.label, stats, text)))
                if grade is None:  # (bench: kept at once, so Ctrl-C keeps it; eval keeps whole graded problems)
                    result.add(prompt, stats)
                on_run(result.config)
        if grade is not None:
            for (result, g), verdict in zip(made, grade(prompt, [g.text for _, g in made])):
                g.verdict = verdict
                result.add(prompt, g.stats, verdict)
        if on_problem is not None:
            on_problem(prompt, [g for _, g in made])
    for result in together:  # (all prompts at once: a row of its own, after the rows that take them one by one)
        run_concurrent(engines[result.config.variant], result, prompts, base, on_run)


def _one_hf(
    engine: SpeculativeEngine, cfg: BenchConfig, i: int, ids: list[int], base: GenerationParams
) -> tuple[SpecStats, str]:
    """transformers' assisted generation, like for like: a constant k draft tokens per step."""
    pair = engine.pair
    if pair.draft is None:
        raise ConfigError("--compare-hf needs a draft model")
    assistant = pair.draft.model
    gc = assistant.generation_config
    gc.num_assistant_tokens = cfg.k
    gc.num_assistant_tokens_schedule = "constant"
    gc.assistant_confidence_threshold = 0.0
    sp = base.sampling
    dev = pair.verifier.device
    torch.manual_seed(base.seed + i)
    x = torch.tensor([ids], device=dev)
    kwargs: dict[str, Any] = dict(
        max_new_tokens=base.max_tokens,
        assistant_model=assistant,
        attention_mask=torch.ones_like(x),
        pad_token_id=pair.tokenizer.pad_token_id or pair.tokenizer.eos_token_id,
    )
    if sp.greedy:
        kwargs.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    else:
        kwargs.update(do_sample=True, temperature=sp.temperature, top_k=sp.top_k or None, top_p=sp.top_p)
    sync(dev)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = pair.verifier.model.generate(x, **kwargs)
    sync(dev)
    seconds = time.perf_counter() - t0  # (the decode below is not timed, as for our engine)
    text = pair.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True)
    return SpecStats(
        prompt_tokens=len(ids), num_output_tokens=int(out.shape[1] - len(ids)), total_seconds=seconds
    ), text


def warm_up(engine: SpeculativeEngine, ids: list[int], base: GenerationParams, k: int) -> None:
    """One short run through every code path before anything is timed (its slow first timings
    teach the cost store nothing: ``learn=False``)."""
    for kk in {0, k} if engine.has_drafter else {0}:
        params = GenerationParams(
            sampling=base.sampling, rule=LOSSLESS, num_draft_tokens=kk, max_tokens=8, seed=0, learn=False
        )
        for _ in engine.generate(ids, params):
            pass


def parse_drafts(text: str) -> list[str]:
    """bench and eval's --draft list, each value checked (ngram, suffix, models, KIND+MODEL)."""
    drafts = parse_list(text, str, "--draft")
    check_each("draft", drafts, "--draft")  # (a KIND+ without a model included)
    return drafts
