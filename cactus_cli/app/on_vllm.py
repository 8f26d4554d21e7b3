"""cactus's commands on vLLM's engine (``--backend vllm``): ``generate`` one prompt, ``bench`` a grid's
rows (every rule x delta at one k per engine, the verifier alone on an engine without drafts), each
request's stats from vLLM's own account of it and the divergence it spent (infer/backends/vllm/offline.py).
The prompts go through the verifier's chat template exactly as on cactus's engine."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from cactus_cli.app import runtime
from cactus_cli.app.config.parsing import parse_draft
from cactus_cli.app.grid.sweep import ConfigResult, longest_prompt
from cactus_cli.core.companions import hide_broken_companions
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.stats import SpecStats
from cactus_cli.infer.backends.vllm import offline
from cactus_cli.infer.backends.vllm.offline import AUTO_K, Plan, unavailable, user_args
from cactus_cli.infer.backends.vllm.plugin import inherit_the_hiding
from cactus_cli.infer.backends.vllm.rows import RowRule
from cactus_cli.infer.draft import KINDS
from cactus_cli.infer.load.sources import Source, load_tokenizer, materialize, resolve_source

SERVE_PARALLEL = 8  # serve --backend vllm: requests in one batch (vLLM's max_num_seqs) unless --parallel says


def _tokenizer(verifier: str):
    src = resolve_source(verifier) if not verifier.startswith("/") else Source("folder", verifier)
    return load_tokenizer(src)


def generate(settings: Any, prompt: str, note: Callable[[str], None]) -> tuple[str, SpecStats, dict[str, Any]]:
    """One prompt: its text, its stats and what vLLM ran (the plan, the rule, the divergence spent)."""
    plan = vllm_plan(settings)
    for line in plan.notes:
        note(line)
    messages = [{"role": "user", "content": prompt}]
    if settings.system:
        messages = [{"role": "system", "content": settings.system}] + messages
    ids = runtime.encode(_tokenizer(plan.verifier), messages, settings.chat_template)
    note(f"starting vLLM (k {plan.k}, {plan.method or 'no drafts'}; about a minute on a CPU)")
    engine = offline.start(plan, [len(ids)], settings.max_tokens, seed=settings.seed)
    done = engine.run(offline.requests_of(settings, [ids], None, settings.seed))[0]
    return done.text, done.stats, describe(plan, done.stats)


def vllm_plan(settings: Any, reporter: Any = None) -> Plan:
    """The settings as vLLM takes them (offline.Plan); a one-line error naming what it does not take."""
    for flag, on in (
        (f"--quantize {settings.quantize}", settings.quantize not in ("auto", "none")),
        ("--compile on", settings.compile == "on"),
        (f"--tp {settings.tp}", settings.tp > 1),
        ("--cross-vocab", settings.cross_vocab not in ("auto",)),
        ("--tokenizer", settings.tokenizer is not None),
    ):
        if on:
            raise ConfigError(f"{flag} does not apply to --backend vllm (vLLM decides it itself); drop it")
    try:
        rule = RowRule.of({"rule": settings.rule, **settings.rule_kwargs()})
    except ValueError as err:
        raise ConfigError(str(err).replace("extra_args.", "--")) from None
    notes = []
    kind, model = parse_draft(settings.draft)
    proposer = KINDS[kind].vllm if kind is not None else None
    if kind is not None and model is None and proposer is None:
        raise ConfigError(f"--draft {kind}: cactus runs no vLLM proposer for it; use --draft ngram or a draft model")
    if kind is not None and model is not None:
        notes.append(f"--draft {settings.draft}: vLLM drafts with one proposer; the model drafts, {kind} does not")
    k = settings.num_draft_tokens
    user_args()  # (checked before anything loads)
    if k == "auto":
        k = AUTO_K
        notes.append(f"-k auto: vLLM drafts a fixed k per engine; running k {AUTO_K} (give -k N to choose)")
    if problem := unavailable():  # (after what the settings alone can say, before any model is converted)
        raise ConfigError(problem)
    folder = materialize(resolve_source(settings.verifier), reporter).location
    draft = materialize(resolve_source(model), reporter).location if model else None
    options = {} if draft or proposer is None else {key: v for key, v in proposer.items() if key != "method"}
    method = "draft_model" if draft else proposer["method"] if proposer else None
    rule_default = {"rule": rule.rule, **dict(rule.params)}
    return Plan(folder, draft, method, int(k), rule_default, options=options, notes=tuple(notes))


def serve(settings: Any, host: str, port: int, api_key: str | None, parallel: int | None, note) -> None:
    """``cactus serve --backend vllm``: this process becomes vLLM's OpenAI server (as ``vllm serve``) on
    the settings' pair, with the plugin, the profile's rule as the engine's default and each
    request's own ``rule`` and ``delta`` (the fields ``cactus serve`` takes) over it. Returns only
    if vLLM could not be started."""
    import os
    import sys

    plan = vllm_plan(settings)
    for line in plan.notes:
        note(line)
    argv = offline.server_argv(plan, host, port, parallel or SERVE_PARALLEL, settings.seed)
    if hide_broken_companions():  # (vLLM's server imports transformers before any plugin: the hiding first)
        inherit_the_hiding()
    env = dict(os.environ, VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "INFO"))
    if api_key:  # (in the environment, not the command line: ps and the line below would show it)
        env["VLLM_API_KEY"] = api_key
    note(f"starting vLLM's server (k {plan.k}, {plan.method or 'no drafts'}): {offline.SERVER} {' '.join(argv)}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", offline.SERVER, *argv], env)


def describe(plan: Any, s: SpecStats) -> dict[str, Any]:
    """What a report says of a vLLM run: its engine and the divergence spent against the budget."""
    spent = s.realized_kl
    return {
        "verifier": plan.verifier,
        "draft": plan.draft,
        "method": plan.method,
        "k": plan.k,
        "rule": plan.rule,
        "kl_spent_mean": sum(spent) / len(spent) if spent else None,
        "kl_spent_max": max(spent) if spent else None,
        "kl_budget": plan.rule.get("delta"),
        "positions_spent": len(spent),
    }


def summary(s: SpecStats, info: dict[str, Any]) -> str:
    """One line for stderr after a generate."""
    parts = [f"vllm k {info['k']}, rule {info['rule']['rule']}"]
    if s.num_drafts:
        pos = " ".join(f"{x:.2f}" for x in s.per_position_acceptance_rate)
        parts.append(f"{s.mean_acceptance_length:.2f} tokens per verify, acceptance {s.draft_acceptance_rate:.2f}")
        parts.append(f"by position [{pos}]")
    if s.decode_tokens_per_second:
        parts.append(f"{s.decode_tokens_per_second:.1f} tok/s decode")
    if info["kl_spent_mean"] is not None:
        budget = f" (budget {info['kl_budget']:g})" if info["kl_budget"] is not None else ""
        parts.append(
            f"KL spent per drafted token: mean {info['kl_spent_mean']:.3f}, max {info['kl_spent_max']:.3f}{budget}"
        )
    return " · ".join(parts)


def run_grid(
    settings: Any, grid: list, prompts: list, concurrency: list[int], sink: list, on_run, note, env: dict
) -> None:
    """bench's rows on vLLM: one engine per k (vLLM's k is per engine) for the speculative rows, then
    one without drafts for the verifier alone; every row the same prompts and seeds (prompt i:
    seed + i). Results go into ``sink`` as they finish and the report's environment additions into
    ``env`` (Ctrl-C, or an engine that does not start, keeps what finished)."""
    plan = vllm_plan(dataclasses.replace(settings, num_draft_tokens=grid[-1].k))
    for line in plan.notes:
        note(line)
    tok = _tokenizer(plan.verifier)
    encoded = runtime.protocol_ids(tok, prompts, settings.chat_template)
    lengths = [longest_prompt(tok, encoded, settings.max_tokens)]  # (a multi-turn question's last turn)
    ks = sorted({c.k for c in grid if c.kind == "speculative"})
    info: dict = {}
    env.update(backend=settings.backend, dtype=offline.user_args().get("dtype", "auto"), vllm=info)
    for k in ks + [0]:
        rows = [c for c in grid if (c.kind == "speculative" and c.k == k) or (k == 0 and c.kind == "autoregressive")]
        if not rows:
            continue
        this = dataclasses.replace(plan, k=k, method=plan.method if k else None)
        note(f"starting vLLM ({f'k {k}, {plan.method}' if k else 'the verifier alone'}; about a minute on a CPU)")
        engine = offline.start(this, lengths, settings.max_tokens, max(concurrency), settings.seed)
        try:
            for cfg in rows:
                result = ConfigResult(cfg, SpecStats(), {}, 0)
                sink.append(result)
                extra = {"rule": cfg.rule, **cfg.rule_kwargs} if cfg.rule else None
                requests = offline.requests_of(settings, [ids for _, ids in encoded], extra, settings.seed)
                for i in range(0, len(requests), cfg.concurrency):
                    t0 = time.perf_counter()
                    group = _asked(engine, tok, encoded[i : i + cfg.concurrency], requests[i : i + cfg.concurrency])
                    if cfg.concurrency > 1:  # (requests together: their own clock, as run_concurrent keeps it)
                        result.wall_seconds += time.perf_counter() - t0
                        result.ttfts += [d.stats.time_to_first_token or 0.0 for d in group]
                        result.request_rates += [
                            d.stats.decode_tokens_per_second for d in group if d.stats.decode_tokens_per_second
                        ]
                    for (prompt, _), done in zip(encoded[i : i + cfg.concurrency], group):
                        result.add(prompt, done.stats)
                        on_run(cfg)
                if cfg.kind == "speculative":
                    info[cfg.label] = describe(dataclasses.replace(this, rule=extra), result.stats)
        finally:
            engine.close()


def _asked(engine: Any, tok: Any, asked: list, requests: list) -> list:
    """``requests`` in one batch, then each multi-turn question's later turns (MT-Bench), each asked
    after the model's own answers through the chat template, the questions still on a turn together;
    a question's stats count every turn (its time to first token is the first turn's)."""
    done = engine.run(requests, len(requests))
    answers = [[d.text] for d in done]
    for turn in range(1, 1 + max(len(p.turns) for p, _ in asked)):
        more = [j for j, (p, _) in enumerate(asked) if len(p.turns) >= turn]
        ids = [runtime.encode(tok, asked[j][0].conversation(answers[j]), asked[j][0].chat) for j in more]
        later = engine.run([dataclasses.replace(requests[j], ids=x) for j, x in zip(more, ids)], len(more))
        for j, d in zip(more, later):
            first = done[j].stats.time_to_first_token
            done[j].stats.merge(d.stats)
            done[j].stats.time_to_first_token = first
            done[j].spent.extend(d.spent)
            answers[j].append(d.text)
            done[j].text = d.text
    return done
