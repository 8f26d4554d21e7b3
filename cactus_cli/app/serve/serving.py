"""What `cactus serve` does, without HTTP: one loaded Session serves up to ``parallel`` requests at
once by continuous batching (infer/decode/batch.py): a request joins the batch at the next step, in
its own engine slot, and leaves when it is done; every step verifies every request's tokens and
drafts in one verifier call. What exceeds ``parallel`` waits in a bounded queue, in arrival order.
All of it runs on one worker thread. A request is the engine's ``Request`` (infer/decode/request.py),
made by ``Server.request`` from its token ids and its overrides (over the session's settings,
checked as flags are), with a ``deliver`` callback the worker hands each step event, then the end
(``Finished``) or the error. A request whose client went away is cancelled between two steps, its
slot free at once. Each slot's KV caches keep what its
last request left, and a request takes the free slot holding the longest prefix of its prompt
among those whose cache it mostly shares, else the least recently used one (a chat header in
common does not overwrite another conversation), and adopts a longer prefix another slot holds,
so a conversation's next turn, or a file an agent sends again, skips that prefix's prefill; the
server keeps max(parallel, PREFIXES) such prefixes.

The HTTP side (app/serve/http_api.py) parses and answers; this module owns the queue, the worker, the
per-request settings and the counters /metrics reports."""

from __future__ import annotations

import dataclasses
import queue
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from cactus_cli.app.config.settings import Settings, build_settings
from cactus_cli.app.runtime import generation_params
from cactus_cli.app.session import Session
from cactus_cli.core.acceptance import RULES
from cactus_cli.core.errors import CactusError, ConfigError
from cactus_cli.core.stats import SpecStats
from cactus_cli.infer.decode.batch import Batch
from cactus_cli.infer.decode.grammar import Grammar
from cactus_cli.infer.decode.request import GenerationParams, Request
from cactus_cli.infer.kpolicy.costs import CostModel
from cactus_cli.infer.runner import common_prefix

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}  # ours -> OpenAI's
PREFIXES = 4  # cached sequences the server keeps at least (aider alternates two conversations)
SIMILAR = 0.5  # a request takes a slot whose cache it shares at least this share of; else the least recently used
ADOPT_MIN = 16  # a prefix another slot holds is adopted when it is this many tokens longer than the chosen slot's
MAX_PARALLEL = 16  # --parallel at most (and the widest a measured default goes)


class FieldError(ConfigError):
    """A request's field has a value cactus cannot take (400, naming ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Busy(CactusError):
    """The queue is full, or the server is stopping: try again later (503)."""


@dataclass
class Finished:
    """The end of a request: its statistics and why it ended (OpenAI's finish_reason)."""

    stats: SpecStats
    finish_reason: str


@dataclass
class Metrics:
    """Counters since start, for /metrics (vLLM's names where vLLM has one)."""

    requests: Counter = field(default_factory=Counter)  # finish reason (stop, length, abort, error) -> count
    rejected: Counter = field(default_factory=Counter)  # why a request got no slot -> count
    prompt_tokens: int = 0
    generation_tokens: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    verify_passes: int = 0
    reused_prefix_tokens: int = 0

    def add(self, stats: SpecStats, reason: str) -> None:
        self.requests[reason] += 1
        self.prompt_tokens += stats.prompt_tokens
        self.generation_tokens += stats.num_output_tokens
        self.drafts += stats.num_drafts
        self.draft_tokens += stats.num_draft_tokens
        self.accepted_tokens += stats.num_accepted_tokens
        self.verify_passes += stats.verifier_forward_passes
        self.reused_prefix_tokens += stats.reused_prefix_tokens


SLOT_TOKENS = 2048  # tokens of KV cache each of --parallel's slots must have room for at least
PARALLEL_GAIN = 1.25  # the measured default doubles N while N requests together decode this much more in all


def choose_parallel(costs: CostModel, limit: int) -> tuple[int, str]:
    """The default --parallel from the verifier's measured cost per width: N requests stepped
    together decode N / t_v(N) tokens per second in all (a plain token each), one alone 1 / t_v(1);
    N doubles while that gains at least PARALLEL_GAIN (each request is slower in a wider step:
    past that, a little more throughput costs every request much of its speed)."""
    if limit <= 1 or not costs.verify:
        return 1, "one request at a time (no measured cost per width yet)" if limit > 1 else "one slot"
    n = 1
    while 2 * n <= limit and (2 * n / costs.t_v(2 * n)) >= PARALLEL_GAIN * (n / costs.t_v(n)):
        n *= 2
    speed = n / costs.t_v(n) * costs.t_v(1)
    nxt = f"; {2 * n} would add {2 * n / costs.t_v(2 * n) / (n / costs.t_v(n)) - 1:.0%}" if 2 * n <= limit else ""
    return n, (
        f"--parallel {n}, measured here: {n} requests stepped together decode {speed:.2f}x one "
        f"request's tokens per second in all ({costs.t_v(n) * 1000:.0f} ms a step against "
        f"{costs.t_v(1) * 1000:.0f} ms){nxt}"
    )


def check_parallel(n: int, bytes_per_token: int, available: int | None) -> None:
    """A one-line error when ``n`` slots of SLOT_TOKENS each do not fit the memory available."""
    need = n * SLOT_TOKENS * bytes_per_token
    if available is not None and need > available:
        fits = max(available // max(SLOT_TOKENS * bytes_per_token, 1), 0)
        raise ConfigError(
            f"--parallel {n}: {n} slots of {SLOT_TOKENS} tokens need {need / 2**30:.1f} GiB of KV cache, "
            f"and {available / 2**30:.1f} GiB of memory is available; use --parallel {max(fits, 1)} or fewer"
        )


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class Server:
    """The session, its queue and its worker. ``submit`` never blocks: a full queue is ``Busy``."""

    def __init__(
        self,
        session: Session,
        max_queue: int = 16,
        log: Callable[[str], None] | None = None,
        max_tokens: int | None = None,
        parallel: int = 1,
    ):
        """``max_tokens``: the most tokens any answer may have (``cactus serve --max-tokens``);
        None: an answer whose request names no max_tokens runs to its end or the context window.
        ``parallel``: requests stepped together (at most the engine's slots)."""
        self.session = session
        self.max_tokens = max_tokens
        self.parallel = max(1, min(parallel, len(session.engine.slots)))
        self.slots = session.engine.slots[: max(self.parallel, min(PREFIXES, len(session.engine.slots)))]
        engine = session.engine
        # (every slot's room now: a llama.cpp context grown mid-run replays every cached sequence)
        if not engine.compiled:
            k = session.params(session.settings).num_draft_tokens
            for slot in self.slots:
                engine.prepare(SLOT_TOKENS, engine.step_widths(k), slot=slot.index)
        # (the requests a slot will take at the next step wait here too: the bound is checked in submit)
        self.queue: queue.Queue[Request | None] = queue.Queue()
        self.max_queue = max_queue
        self._admitting = threading.Lock()
        self.metrics = Metrics()
        self.running: list[Request] = []  # in the batch, in the order they joined
        self.stopping = threading.Event()
        self.log = log  # --log-requests: where the requests' text goes (None: nowhere)
        self.started = time.time()
        self.batch = Batch(session.engine)
        self.worker = threading.Thread(target=self._work, name="cactus-serve-worker", daemon=True)
        self.worker.start()

    @property
    def model_id(self) -> str:
        return self.session.settings.verifier or "cactus"

    @property
    def context_length(self) -> int:
        return self.session.engine.context_length

    def settings_for(self, overrides: dict[str, Any]) -> Settings:
        """The session's settings with a request's (Settings keys), checked as flags are (a bad
        value is a ``FieldError`` naming its field); a fresh seed unless the request gave one (two
        requests without a seed sample differently)."""
        if "draft" in overrides:
            draft = overrides["draft"]
            if draft not in ("none", self.session.settings.draft):
                loaded = self.session.settings.draft or "none"
                raise FieldError(
                    "draft",
                    f"draft {draft!r}: this server loaded draft {loaded!r}; a request may ask for 'none' or that",
                )
            overrides = {**overrides, "draft": None if draft == "none" else draft}
        overrides = {"seed": secrets.randbelow(2**31), **overrides}
        base = (dataclasses.asdict(self.session.settings), "the server's settings")
        for key, value in overrides.items():  # each alone first, so that an error names its field
            try:
                build_settings(base, ({key: value}, "the request"))
            except ConfigError as err:
                raise FieldError(key, str(err)) from None
        settings = build_settings(base, (overrides, "the request"))
        if settings.draft is None and "num_draft_tokens" in overrides:
            raise FieldError("num_draft_tokens", "num_draft_tokens has no effect without a draft (draft 'none')")
        return settings

    def request(
        self,
        ids: list[int],
        overrides: dict[str, Any],
        deliver: Callable[[Any], None],
        label: str = "",
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> Request:
        """A request for ``ids``, its settings checked and its length too (a 400, before any
        queueing). A request that names no max_tokens generates until the end of sequence or the
        context window (as OpenAI's API and llama-server do), within the server's cap if it has one.
        ``deliver``: where its events go (from the worker thread); ``label``: what --log-requests
        prints; ``logprobs``: each token's log-probability and that many alternatives (None: none);
        ``grammar``: what the answer must match (JSON output), or anything; ``sampling``:
        SamplingParams fields other servers take (http_fields.sampling_fields)."""
        room = self.context_length - len(ids)
        if room <= 0:
            raise FieldError(
                "messages",
                f"the prompt is {len(ids)} tokens but the context window is {self.context_length}; shorten it",
            )
        asked = overrides.get("max_tokens")
        if asked is not None and self.max_tokens is not None and asked > self.max_tokens:
            raise FieldError(
                "max_tokens",
                f"max_tokens {asked} is over this server's cap of {self.max_tokens} (cactus serve --max-tokens); "
                f"ask for at most {self.max_tokens}, or leave it out",
            )
        if asked is None:
            overrides = {**overrides, "max_tokens": min(room, self.max_tokens or room)}
        settings = self.settings_for(overrides)
        if settings.max_tokens > room:
            raise FieldError(
                "max_tokens",
                f"max_tokens {settings.max_tokens} does not fit: the prompt is {len(ids)} tokens of a "
                f"{self.context_length}-token context window, so at most {room} remain",
            )
        params = generation_params(settings, given=overrides)  # (a rule parameter its rule does not take: a 400)
        params = dataclasses.replace(
            params,
            logprobs=logprobs,
            grammar=grammar,
            sampling=dataclasses.replace(params.sampling, **(sampling or {})),
        )
        return self.session.engine.request(ids, params, deliver, label)

    def submit(self, req: Request) -> None:
        if self.stopping.is_set():
            self.metrics.rejected["stopping"] += 1
            raise Busy("the server is shutting down")
        with self._admitting:  # (a request waits only when no slot is free: --parallel plus --max-queue at once)
            if self.queue.qsize() >= self.max_queue + max(0, self.parallel - len(self.running)):
                self.metrics.rejected["queue full"] += 1
                raise Busy(f"the queue is full ({self.max_queue} requests waiting); retry shortly")
            self.queue.put_nowait(req)

    def stop(self) -> None:
        """Take no more requests; the running ones end after the current step (finish_reason abort),
        the waiting ones end at once; the worker exits."""
        self.stopping.set()
        while True:
            try:
                req = self.queue.get_nowait()
            except queue.Empty:
                break
            if req is not None:
                self.metrics.rejected["stopping"] += 1
                self._send(req, Busy("the server is shutting down"))
        self.queue.put(None)

    @staticmethod
    def _send(req: Request, item: Any) -> None:
        """Hand ``item`` to the request's client; one that cannot take it any more has gone (cancel)."""
        try:
            req.deliver(item)
        except Exception:  # noqa: BLE001 (a closed event loop, a dead client: never the worker's end)
            req.cancel()

    def _work(self) -> None:
        closing = False
        while not closing or self.running:
            while not closing and len(self.running) < self.parallel:
                try:
                    req = self.queue.get(block=not self.running)  # (idle: wait for one; busy: take what waits)
                except queue.Empty:
                    break
                if req is None:
                    closing = True
                    break
                if req.cancelled or self.stopping.is_set():  # its client left while it waited
                    self._send(req, Finished(SpecStats(), "abort"))
                    continue
                self._admit(req)
            if self.running:
                try:
                    self._step()
                except Exception as err:  # noqa: BLE001 (never the worker's end: every running request gets it)
                    for req in list(self.running):
                        self.batch.cancel(req)
                        self.running.remove(req)
                        self.metrics.requests["error"] += 1
                        self._send(req, err)

    def _admit(self, req: Request) -> None:
        """``req`` joins the batch (prefilled at the next step) in the free slot holding the longest
        prefix of its prompt among those whose cache it shares at least SIMILAR of (an empty one
        does), else the least recently used free slot; a longer prefix another slot holds is adopted."""
        busy = {run.slot.index for run in self.running}
        shared = {s.index: common_prefix(s.tokens[: s.verifier.cache_len], req.prompt) for s in self.slots}
        free = [s for s in self.slots if s.index not in busy]
        similar = [s for s in free if shared[s.index] >= SIMILAR * s.verifier.cache_len]
        if similar:
            slot = max(similar, key=lambda s: (shared[s.index], -s.used))
        else:
            slot = min(free, key=lambda s: s.used)
        donor = max(self.slots, key=lambda s: shared[s.index])
        donor = donor if shared[donor.index] >= shared[slot.index] + ADOPT_MIN else None
        if self.log is not None and req.label:
            self.log(f"request: {req.label!r}")
        try:  # (the cost probe, where -k auto has nothing measured here, only while no other run holds caches)
            self.session.engine.place(req, slot.index, probe=not self.running)
        except Exception as err:  # noqa: BLE001 (one request's failure is its answer, not the server's end)
            self.metrics.requests["error"] += 1
            self._send(req, err)
            return
        self.running.append(self.batch.add(req, reuse=True, donor=donor))

    def _step(self) -> None:
        """One step of every running request; each gets its event, its end or its error; then the
        requests whose client left (or every one, when stopping) end between steps."""
        for req, item in self.batch.step():
            if isinstance(item, BaseException):
                self.running.remove(req)
                self.metrics.requests["error"] += 1
                self._send(req, item)
                continue
            self._send(req, item)
            if item.finish_reason:
                self._done(req, FINISH.get(item.finish_reason, "stop"))
        for req in list(self.running):
            if req.cancelled or self.stopping.is_set():
                self.batch.cancel(req)
                self._done(req, "abort")

    def _done(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        stats = dataclasses.replace(req.stats)
        self.metrics.add(stats, reason)
        if self.log is not None and req.label:
            self.log(f"answer ({reason}, {stats.num_output_tokens} tokens)")
        self._send(req, Finished(stats, reason))

    def speculative(self, params: GenerationParams, stats: SpecStats) -> dict[str, Any]:
        """What a response says about its speculation: the rule, its budget, the k policy and what
        the drafts bought."""
        rule = RULES[params.rule]
        drafts = params.num_draft_tokens > 0
        return {
            "rule": params.rule,
            "params": dict(params.rule_kwargs),
            "lossless": rule.lossless,
            "draft": self.session.settings.draft if drafts else "none",
            "num_draft_tokens": ("auto" if params.adaptive_k else params.num_draft_tokens) if drafts else 0,
            "drafted": stats.num_draft_tokens,
            "accepted": stats.num_accepted_tokens,
            "verifier_forward_passes": stats.verifier_forward_passes,
            "mean_acceptance_length": stats.mean_acceptance_length,  # 1 + accepted per drafting step
            "tokens_per_verifier_pass": (
                round(stats.num_output_tokens / stats.verifier_forward_passes, 4)
                if stats.verifier_forward_passes
                else None
            ),
            "reused_prefix_tokens": stats.reused_prefix_tokens,
            "by_source": {
                src: {"drafted": n, "accepted": stats.accepted_by_source.get(src, 0)}
                for src, n in stats.drafted_by_source.items()
            },
        }

    def prometheus(self) -> str:
        """/metrics in Prometheus' text format."""
        m = self.metrics
        mal = 1 + m.accepted_tokens / m.drafts if m.drafts else 0.0  # (the speculative object's definition)
        per_pass = m.generation_tokens / m.verify_passes if m.verify_passes else 0.0
        lines = [
            ("vllm:num_requests_running", "gauge", "Requests being generated.", [("", len(self.running))]),
            ("vllm:num_requests_waiting", "gauge", "Requests waiting in the queue.", [("", self.queue.qsize())]),
            (
                "vllm:request_success_total",
                "counter",
                "Requests finished, by finish reason.",
                [(f'{{finished_reason="{r}"}}', n) for r, n in sorted(m.requests.items())] or [("", 0)],
            ),
            (
                "cactus_requests_rejected_total",
                "counter",
                "Requests turned away (503), by reason.",
                [(f'{{reason="{r}"}}', n) for r, n in sorted(m.rejected.items())] or [("", 0)],
            ),
            ("vllm:prompt_tokens_total", "counter", "Prompt tokens.", [("", m.prompt_tokens)]),
            ("vllm:generation_tokens_total", "counter", "Generated tokens.", [("", m.generation_tokens)]),
            ("vllm:spec_decode_num_drafts_total", "counter", "Steps that drafted.", [("", m.drafts)]),
            ("vllm:spec_decode_num_draft_tokens_total", "counter", "Drafted tokens.", [("", m.draft_tokens)]),
            (
                "vllm:spec_decode_num_accepted_tokens_total",
                "counter",
                "Drafted tokens accepted.",
                [("", m.accepted_tokens)],
            ),
            ("cactus_verify_passes_total", "counter", "Verifier forward passes.", [("", m.verify_passes)]),
            (
                "cactus_reused_prefix_tokens_total",
                "counter",
                "Prompt tokens served from the KV cache.",
                [("", m.reused_prefix_tokens)],
            ),
            (
                "cactus_mean_acceptance_length",
                "gauge",
                "1 + accepted drafts per drafting step (vLLM's and the speculative object's definition).",
                [("", round(mal, 4))],
            ),
            (
                "cactus_tokens_per_verifier_pass",
                "gauge",
                "Generated tokens per verifier forward pass (prefills and plain steps counted).",
                [("", round(per_pass, 4))],
            ),
        ]
        out = []
        for name, kind, doc, samples in lines:
            out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
            out += [f"{name}{labels} {value}" for labels, value in samples]
        return "\n".join(out) + "\n"
