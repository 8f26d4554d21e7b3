"""What `cactus serve` does, without HTTP: one loaded Session serves requests one at a time, in
arrival order, from a bounded queue, on one worker thread (one model pair on a CPU has no spare
cores to run two: batching is a later step). A request is a ``Job``: its token ids, its settings
(the session's with the request's overrides, checked as flags are), and a ``deliver`` callback the
worker hands each step event, then the end (``Finished``) or the error. A job whose client went
away is cancelled between two steps; the KV caches keep what the last request left, so a request
that shares a prefix with it skips that prefix's prefill (``reuse_cache``).

The HTTP side (app/http_api.py) parses and answers; this module owns the queue, the worker, the
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

from cactus_cli.app.session import Session
from cactus_cli.app.settings import Settings, build_settings, inert_rule_param
from cactus_cli.core.acceptance import RULES
from cactus_cli.core.errors import CactusError, ConfigError
from cactus_cli.core.stats import SpecStats
from cactus_cli.infer.engine import GenerationParams

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}  # ours -> OpenAI's


class FieldError(ConfigError):
    """A request's field has a value cactus cannot take (400, naming ``param``)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class Busy(CactusError):
    """The queue is full, or the server is stopping: try again later (503)."""


@dataclass
class Finished:
    """The end of a job: its statistics and why it ended (OpenAI's finish_reason)."""

    stats: SpecStats
    finish_reason: str


@dataclass
class Job:
    ids: list[int]
    settings: Settings
    params: GenerationParams
    deliver: Callable[[Any], None]  # (from the worker thread) each StepEvent, then Finished or an exception
    cancel: threading.Event = field(default_factory=threading.Event)
    label: str = ""  # what --log-requests prints (the request's text); empty otherwise


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


class Server:
    """The session, its queue and its worker. ``submit`` never blocks: a full queue is ``Busy``."""

    def __init__(
        self,
        session: Session,
        max_queue: int = 16,
        log: Callable[[str], None] | None = None,
        max_tokens: int | None = None,
    ):
        """``max_tokens``: the most tokens any answer may have (``cactus serve --max-tokens``);
        None: an answer whose request names no max_tokens runs to its end or the context window."""
        self.session = session
        self.max_tokens = max_tokens
        self.queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.metrics = Metrics()
        self.running: Job | None = None
        self.stopping = threading.Event()
        self.log = log  # --log-requests: where the requests' text goes (None: nowhere)
        self.started = time.time()
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
        if inert := inert_rule_param(settings.rule, overrides):  # (never a silent no-op)
            key, rules = inert
            raise FieldError(key, f"{key} has no effect with rule {settings.rule!r}; use rule {' or '.join(rules)}")
        if settings.draft is None and "num_draft_tokens" in overrides:
            raise FieldError("num_draft_tokens", "num_draft_tokens has no effect without a draft (draft 'none')")
        return settings

    def job(self, ids: list[int], overrides: dict[str, Any], deliver: Callable[[Any], None], label: str = "") -> Job:
        """A job for ``ids``, its settings checked and its length too (a 400, before any queueing).
        A request that names no max_tokens generates until the end of sequence or the context
        window (as OpenAI's API and llama-server do), within the server's cap if it has one."""
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
        return Job(list(ids), settings, self.session.params(settings), deliver, label=label)

    def submit(self, job: Job) -> None:
        if self.stopping.is_set():
            self.metrics.rejected["stopping"] += 1
            raise Busy("the server is shutting down")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            self.metrics.rejected["queue full"] += 1
            raise Busy(f"the queue is full ({self.queue.maxsize} requests waiting); retry shortly") from None

    def stop(self) -> None:
        """Take no more jobs; the running one ends after its current step (finish_reason abort), the
        waiting ones end at once; the worker exits."""
        self.stopping.set()
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self.metrics.rejected["stopping"] += 1
                self._send(job, Busy("the server is shutting down"))
        self.queue.put(None)

    @staticmethod
    def _send(job: Job, item: Any) -> None:
        """Hand ``item`` to the job's client; one that cannot take it any more has gone (cancel)."""
        try:
            job.deliver(item)
        except Exception:  # noqa: BLE001 (a closed event loop, a dead client: never the worker's end)
            job.cancel.set()

    def _work(self) -> None:
        while (job := self.queue.get()) is not None:
            if job.cancel.is_set() or self.stopping.is_set():  # its client left while it waited
                self._send(job, Finished(SpecStats(), "abort"))
                continue
            self.running = job
            try:
                self._run(job)
            finally:
                self.running = None

    def _run(self, job: Job) -> None:
        session = self.session
        if self.log is not None and job.label:
            self.log(f"request: {job.label!r}")
        reason = "abort"
        events = session.generate(job.ids, params=job.params, reuse_cache=True)
        try:
            for event in events:
                self._send(job, event)
                if event.finish_reason:
                    reason = FINISH.get(event.finish_reason, "stop")
                elif job.cancel.is_set() or self.stopping.is_set():
                    break  # (closing the events between steps leaves the caches consistent)
        except Exception as err:  # noqa: BLE001 (one request's failure is its answer, not the server's end)
            self.metrics.requests["error"] += 1
            self._send(job, err)
            return
        finally:
            events.close()
        stats = dataclasses.replace(session.stats)
        self.metrics.add(stats, reason)
        if self.log is not None and job.label:
            self.log(f"answer ({reason}, {stats.num_output_tokens} tokens)")
        self._send(job, Finished(stats, reason))

    def speculative(self, settings: Settings, stats: SpecStats) -> dict[str, Any]:
        """What a response says about its speculation: the rule, its budget, the k policy and what
        the drafts bought."""
        rule = RULES[settings.rule]
        return {
            "rule": settings.rule,
            "params": settings.rule_kwargs(),
            "lossless": rule.lossless,
            "draft": settings.draft or "none",
            "num_draft_tokens": settings.num_draft_tokens if settings.draft else 0,
            "drafted": stats.num_draft_tokens,
            "accepted": stats.num_accepted_tokens,
            "verifier_forward_passes": stats.verifier_forward_passes,
            "mean_acceptance_length": stats.mean_acceptance_length,
            "reused_prefix_tokens": stats.reused_prefix_tokens,
            "by_source": {
                src: {"drafted": n, "accepted": stats.accepted_by_source.get(src, 0)}
                for src, n in stats.drafted_by_source.items()
            },
        }

    def prometheus(self) -> str:
        """/metrics in Prometheus' text format."""
        m = self.metrics
        mal = (m.generation_tokens / m.verify_passes) if m.verify_passes else 0.0
        lines = [
            ("vllm:num_requests_running", "gauge", "Requests being generated.", [("", int(self.running is not None))]),
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
            ("cactus_mean_acceptance_length", "gauge", "Generated tokens per verifier pass.", [("", round(mal, 4))]),
        ]
        out = []
        for name, kind, doc, samples in lines:
            out += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
            out += [f"{name}{labels} {value}" for labels, value in samples]
        return "\n".join(out) + "\n"
