"""cactus from Python: one entry point, the same engine and step events the commands use.

    from cactus_cli.api import Session

    session = Session.load("default", max_tokens=64)        # a profile, keyword arguments over it
    for event in session.generate("Write a haiku about rain."):
        print(event.text, end="", flush=True)                # accepted drafts, corrections, bonus tokens
    print(f"\\n{session.stats.tokens_per_second:.1f} tok/s, "
          f"mean acceptance length {session.stats.mean_acceptance_length:.2f}")

``Session.load(profile, **settings)`` takes any profile key (verifier, draft, rule, delta,
num_draft_tokens, temperature, backend, ...); ``generate(prompt, **overrides)`` yields one
``StepEvent`` per verification step; ``text(prompt)`` returns the whole completion.
"""

from cactus_cli.app.session import Session
from cactus_cli.core.events import StepEvent
from cactus_cli.core.stats import SpecStats

__all__ = ["Session", "SpecStats", "StepEvent"]
