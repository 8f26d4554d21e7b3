"""Parsing what users type: YAML (profiles, --param, /set), --param KEY=VALUE, -k lists, comma
lists and --draft values, each failure one ConfigError line naming where."""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from cactus_cli.core.errors import ConfigError, warn
from cactus_cli.infer.draft import KINDS


def _loader():
    """yaml's SafeLoader that also reads numbers as users write them: YAML 1.1 (PyYAML) takes
    ``1e-3`` for a string (it wants ``1.0e-3``); YAML 1.2 and every other parser read a float."""
    import yaml

    global _LOADER
    if _LOADER is None:

        class Loader(yaml.SafeLoader):
            pass

        Loader.add_implicit_resolver(
            "tag:yaml.org,2002:float",
            re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
            list("-+0123456789"),
        )
        _LOADER = Loader
    return _LOADER


_LOADER = None


def parse_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` for what users write (profiles, --param, /set), with every failure one
    ConfigError line naming ``where``. Aliases are refused before anything is built: a few
    hundred bytes of nested aliases expand to 10^8 entries when the result is walked."""
    import yaml

    try:
        for event in yaml.parse(text):  # events only: nothing is expanded yet
            if isinstance(event, yaml.AliasEvent):
                raise ConfigError(
                    f"{where}:{event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not "
                    "allowed here; write the value out"
                )
        return yaml.load(text, Loader=_loader())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise ConfigError(f"{where}{line}: not valid YAML ({problem})") from None
    except RecursionError:
        raise ConfigError(f"{where}: YAML nested too deeply") from None


def uses_lookup(draft: str | None, kind: str | None = None) -> bool:
    """Whether a draft value drafts without a model first (``ngram``, ``suffix``, ``KIND+MODEL``);
    with ``kind``, by that one."""
    return draft is not None and parse_draft(draft)[0] in ((kind,) if kind else KINDS)


def parse_draft(spec: str | None) -> tuple[str | None, str | None]:
    """A draft value: ``MODEL``; ``ngram`` (prompt lookup) or ``suffix`` (the suffix trees)
    alone; or ``ngram+MODEL`` / ``suffix+MODEL`` (the model drafts when they have nothing).
    Returns (the lookup kind or None, the model source or None)."""
    if spec is None:
        return None, None
    if spec in KINDS:
        return spec, None
    for kind in KINDS:
        if spec.startswith(kind + "+"):
            model = spec[len(kind) + 1 :].strip()
            if not model:
                raise ConfigError(
                    f"--draft {kind}+MODEL: name the draft model after the +, e.g. {kind}+embedded:qwen2.5-coder-0.5b"
                )
            return kind, model
    return None, spec


def parse_params(items: list[str] | None, flag: str = "--param") -> dict[str, Any]:
    """--param (or --draft-param) KEY=VALUE pairs; values parsed as YAML scalars (numbers, strings)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            example = "divergence=chi2" if flag == "--param" else "ngram_max=3"
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} {example}")
        out[key.strip()] = parse_yaml(value, f"{flag} {key.strip()}")
    return out


def parse_k(text: str | int, flag: str) -> int | str:
    """``auto`` or an integer (range checked with the other settings)."""
    if isinstance(text, int) or str(text).strip().lower() == "auto":
        return text if isinstance(text, int) else "auto"
    try:
        return int(str(text).strip())
    except ValueError:
        raise ConfigError(f"{flag}: expected an integer in 1..64 or auto, got {text!r}") from None


def parse_list(text: str, cast: Callable[[str], Any], flag: str) -> list[Any]:
    """A comma list (bench and calibrate sweep several values), each value once: a value given
    twice (``-k 2,2``, ``--delta 1,1.0``) runs once, said in one line. Numbers must be finite."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ConfigError(f"{flag}: give a comma-separated list, e.g. {flag} 1,2")
    try:
        values = [cast(t) for t in items]
    except ValueError:
        raise ConfigError(f"{flag}: cannot read {text!r} as a comma-separated list of {cast.__name__}s") from None
    for v in values:
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{flag}: each value must be a finite number, got {v!r}")
    return unique(values, flag)


def unique(values: list[Any], flag: str) -> list[Any]:
    """``values`` without repeats (first kept), a repeat said in one line."""
    kept = list(dict.fromkeys(values))
    if len(kept) < len(values):
        twice = [v for i, v in enumerate(values) if v in values[:i]]
        warn(f"{flag}: {', '.join(dict.fromkeys(str(v) for v in twice))} given more than once; each runs once")
    return kept


def parse_ks(text: str) -> list[int | str]:
    """A -k list: integers and ``auto``, each once."""
    return unique([parse_k(t, "-k") for t in parse_list(text, str, "-k")], "-k")
