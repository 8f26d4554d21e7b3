"""A loaded model pair and its settings, ready to generate: the one front end that `generate`, `chat`,
`calibrate`, `serve` and the lm-eval adapter hold, and what cactus_cli.api offers Python callers.

    session = Session.load("default", max_tokens=64)
    for event in session.generate("Write a haiku about rain."):
        print(event.text, end="")
    print(session.stats.tokens_per_second)

``load`` resolves the settings once (defaults < profile < the keyword arguments, each checked as
a flag would be), loads the engine, and ``generate`` encodes the prompt (the chat template when
the tokenizer has one, the system prompt first), prepares the engine for it (compiled steps, the
cost probe) and yields the engine's step events, the same stream the CLI renders; ``stats`` counts
the last one. The engine keeps only its caches between calls (a prompt that shares a prefix with
the last sequence skips it with ``reuse_cache``); each generation's state lives in the generator
the caller iterates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator

from cactus_cli.app import runtime
from cactus_cli.app.config.profile_files import resolve_settings
from cactus_cli.app.config.settings import (
    Settings,
    build_settings,
    check_flags_apply,
    flags_to_settings,
    with_seed,
)
from cactus_cli.core.events import StepEvent
from cactus_cli.core.stats import SpecStats
from cactus_cli.infer.decode.engine import GenerationParams, SpeculativeEngine


@dataclass
class Session:
    settings: Settings
    engine: SpeculativeEngine
    stats: SpecStats = field(default_factory=SpecStats)  # the last request's own (Request.stats)

    @classmethod
    def load(
        cls,
        profile: str | None = None,
        *,
        settings: Settings | None = None,
        reporter: Any = None,
        sequences: int = 1,
        **flags: Any,
    ) -> "Session":
        """The ``profile`` (name or path; the default profile when None) with ``flags`` over it
        (Settings keys: verifier=..., draft=..., max_tokens=..., as on the command line), or
        ``settings`` as they are; then the engine, loaded, with ``sequences`` slots (requests
        stepped together: serve, bench --concurrency)."""
        if settings is None:
            given = flags_to_settings(**flags)
            settings = resolve_settings(profile, given)
            check_flags_apply(settings, given)
        settings = with_seed(settings)
        return cls(settings, runtime.load_engine(settings, reporter, sequences=sequences))

    @property
    def tokenizer(self) -> Any:
        return self.engine.pair.tokenizer

    @property
    def context_length(self) -> int:
        return self.engine.context_length

    @property
    def has_drafter(self) -> bool:
        return self.engine.has_drafter

    def encode(
        self, prompt: str | list[dict[str, Any]] | list[int], tools: list | None = None, **render: Any
    ) -> list[int]:
        """Token ids: a list of ids as it is; a string or chat messages through the chat template
        (when the tokenizer has one), the settings' system prompt first; ``tools`` rendered by
        the template; ``render``: runtime.encode's keywords (a continued final message, ...)."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.settings.system and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.settings.system}] + messages
        return runtime.encode(self.tokenizer, messages, self.settings.chat_template, tools, **render)

    def with_settings(self, **overrides: Any) -> Settings:
        """These settings with ``overrides`` (Settings keys), checked; the models stay as loaded."""
        if not overrides:
            return self.settings
        return build_settings((dataclasses.asdict(self.settings), "the session"), (overrides, "the call"))

    def params(self, settings: Settings | None = None) -> GenerationParams:
        return runtime.generation_params(settings or self.settings)

    def encode_prompts(self, prompts: list) -> list[tuple[Any, list[int]]]:
        """A prompt set (bench, calibrate, eval) encoded as each prompt asks, each checked to fit."""
        return runtime.encode_prompts(self.engine, prompts, self.settings.chat_template)

    def prepare(
        self,
        prompt_tokens: int = runtime.PROMPT_ALLOWANCE,
        reporter: Any = None,
        settings: Settings | None = None,
        k_values: list[int | str] | None = None,
        whole_context: bool = False,
        slot: int = 0,
        probe: bool = True,
    ) -> None:
        """Before anything is timed: compiled steps and, for -k auto on a new pair, the cost probe
        (``k_values``: the k a sweep will use; ``whole_context``: a chat sizes for the window;
        ``slot``: the engine slot it will run in; ``probe`` False: other runs hold the caches)."""
        runtime.prepare(
            self.engine, settings or self.settings, reporter, prompt_tokens, k_values, whole_context, slot, probe
        )

    def report_to(self, note: Any) -> None:
        """Where progress lines during generation go (a long chat outgrows a compiled cache)."""
        self.engine.report = note

    def reset(self) -> None:
        """Forget both caches: the next generation prefills from scratch."""
        self.engine.reset()

    def cost_summary(self, settings: Settings | None = None) -> dict[str, Any]:
        """The cost model's figures and acceptance estimate for these settings (chat's /stats)."""
        return self.engine.cost_summary(self.params(settings))

    def verifier_logits(self, ids: list[int], keep: int) -> Any:
        """The verifier's logits [keep, V] for the last ``keep`` positions of ``ids``, from empty
        caches (scoring, temperature 1, no filtering); the caches are dropped afterwards."""
        return self.engine.score(ids, keep)

    def generate(
        self,
        prompt: str | list[dict[str, str]] | list[int],
        *,
        reuse_cache: bool = False,
        params: GenerationParams | None = None,
        **overrides: Any,
    ) -> Iterator[StepEvent]:
        """The engine's step events for ``prompt`` (``params`` as given, else the settings with
        ``overrides``); ``stats`` is this request's, counted as they come."""
        settings = self.with_settings(**overrides)
        ids = self.encode(prompt)
        self.prepare(len(ids), settings=settings)
        run = self.engine.start(ids, params or self.params(settings))
        self.stats = run.stats  # (the request's own, counted as its events come)
        yield from self.engine.events(run, reuse_cache)

    def text(self, prompt: str | list[dict[str, str]] | list[int], **overrides: Any) -> str:
        """The whole completion as text."""
        return "".join(event.text for event in self.generate(prompt, **overrides))
