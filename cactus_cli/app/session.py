"""A loaded model pair and its settings, ready to generate: what `generate`, `chat`, `calibrate` and
the lm-eval adapter hold, and what cactus_cli.api offers Python callers.

    session = Session.load("default", max_tokens=64)
    for event in session.generate("Write a haiku about rain."):
        print(event.text, end="")
    print(session.stats.tokens_per_second)

``load`` resolves the settings once (defaults < profile < the keyword arguments, each checked as
a flag would be), loads the engine, and ``generate`` encodes the prompt (the chat template when
the tokenizer has one), prepares the engine for it (compiled steps, the cost probe) and yields
the engine's step events, the same stream the CLI renders; ``stats`` counts the last one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator

from cactus_cli.app import runtime
from cactus_cli.app.profiles import resolve_settings
from cactus_cli.app.settings import (
    Settings,
    build_settings,
    check_flags_apply,
    flags_to_settings,
    with_seed,
)
from cactus_cli.core.events import StepEvent
from cactus_cli.core.stats import SpecStats
from cactus_cli.infer.engine import GenerationParams, SpeculativeEngine


@dataclass
class Session:
    settings: Settings
    engine: SpeculativeEngine
    stats: SpecStats = field(default_factory=SpecStats)  # the last generation's

    @classmethod
    def load(
        cls, profile: str | None = None, *, settings: Settings | None = None, reporter: Any = None, **flags: Any
    ) -> "Session":
        """The ``profile`` (name or path; the default profile when None) with ``flags`` over it
        (Settings keys: verifier=..., draft=..., max_tokens=..., as on the command line), or
        ``settings`` as they are; then the engine, loaded."""
        if settings is None:
            given = flags_to_settings(**flags)
            settings = resolve_settings(profile, given)
            check_flags_apply(settings, given)
        settings = with_seed(settings)
        return cls(settings, runtime.load_engine(settings, reporter))

    @property
    def tokenizer(self) -> Any:
        return self.engine.pair.tokenizer

    def encode(self, prompt: str | list[dict[str, str]] | list[int]) -> list[int]:
        """Token ids: a list of ids as it is; a string or chat messages through the chat template
        (when the tokenizer has one), the settings' system prompt first."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.settings.system and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": self.settings.system}] + messages
        return runtime.encode(self.tokenizer, messages, self.settings.chat_template)

    def with_settings(self, **overrides: Any) -> Settings:
        """These settings with ``overrides`` (Settings keys), checked; the models stay as loaded."""
        if not overrides:
            return self.settings
        return build_settings((dataclasses.asdict(self.settings), "the session"), (overrides, "the call"))

    def params(self, settings: Settings | None = None) -> GenerationParams:
        return runtime.generation_params(settings or self.settings)

    def prepare(self, prompt_tokens: int, reporter: Any = None, settings: Settings | None = None) -> None:
        """Before anything is timed: compiled steps and, for -k auto on a new pair, the cost probe."""
        runtime.prepare(self.engine, settings or self.settings, reporter, prompt_tokens)

    def generate(
        self,
        prompt: str | list[dict[str, str]] | list[int],
        *,
        reuse_cache: bool = False,
        params: GenerationParams | None = None,
        **overrides: Any,
    ) -> Iterator[StepEvent]:
        """The engine's step events for ``prompt`` (``params`` as given, else the settings with
        ``overrides``); ``stats`` counts them as they come."""
        settings = self.with_settings(**overrides)
        ids = self.encode(prompt)
        self.prepare(len(ids), settings=settings)
        self.stats = SpecStats()
        for event in self.engine.generate(ids, params or self.params(settings), reuse_cache):
            self.stats.update(event)
            yield event

    def text(self, prompt: str | list[dict[str, str]] | list[int], **overrides: Any) -> str:
        """The whole completion as text."""
        return "".join(event.text for event in self.generate(prompt, **overrides))
