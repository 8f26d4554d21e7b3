"""Settings: everything a run needs besides the prompt (defaults from core/defaults.py), the
checks every value passes wherever it comes from (a profile, a flag, chat's /set, lm-eval's
model_args), and the parsing helpers for what users type: --param KEY=VALUE, -k lists, comma
lists, --draft values. Settings are frozen: change one with ``dataclasses.replace``.
"""

from __future__ import annotations

import math
import re
import types
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable

from cactus_cli.core import defaults
from cactus_cli.core.acceptance import RULES, resolve_params
from cactus_cli.core.errors import ConfigError, warn
from cactus_cli.core.fileio import clean_text

DEVICES = ("auto", "cpu", "cuda", "mps")
MAX_DELTA = 1e6  # nats; any budget this large already accepts every draft, and larger ones overflow float32
MIN_TEMPERATURE = 1e-3  # below this, logits / T overflows to inf and probabilities to NaN: use 0 (greedy)
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds; bench adds the prompt index
DTYPES = ("auto", "float32", "float16", "bfloat16")
COMPILE = ("auto", "on", "off")
QUANTIZE = ("auto", "none", "int8", "int4", "w8a8", "q4_0")  # q4_0: a GGUF requantized for llama.cpp
CROSS_VOCAB = ("auto", "string", "intersection")
BACKENDS = ("auto", "torch", "llama.cpp")
_LISTS = " (a comma list is for bench and eval, to compare several in one run)"
RULE_PARAM_KEYS = ("divergence", "epsilon", "alpha", "topk")  # rule parameters other than delta


@dataclass(frozen=True)
class Settings:
    """Everything a run needs besides the prompt. Field defaults are the built-in defaults."""

    description: str = ""
    verifier: str | None = None  # model source: hub id, local folder, .gguf file, or "embedded:NAME"
    draft: str | None = None  # None: the verifier alone (autoregressive)
    tokenizer: str | None = None  # tokenizer source for both models (default: the verifier's)
    cross_vocab: str = defaults.CROSS_VOCAB  # a draft with another tokenizer: string (SLEM), intersection (TLI), auto
    rule: str = defaults.RULE
    delta: float = defaults.DELTA  # divergence budget, for cactus and cactus-exact
    rule_params: dict[str, Any] = field(default_factory=dict)  # divergence, epsilon, alpha, topk
    num_draft_tokens: int | str = (
        defaults.NUM_DRAFT_TOKENS
    )  # k, or "auto": the engine picks k in 0..max_draft_tokens per step
    max_draft_tokens: int = defaults.MAX_DRAFT_TOKENS  # k_max for num_draft_tokens: auto
    ngram_max: int = defaults.NGRAM_MAX  # prompt lookup (draft: ngram or ngram+MODEL): the longest n-gram matched ...
    ngram_min: int = defaults.NGRAM_MIN  # ... and the shortest
    remember: str | None = None  # draft: suffix or suffix+MODEL: a file the history tree is loaded from and saved to
    history: str | None = None  # chat: a file keeping the lines typed at its prompt (mode 0600); none by default
    temperature: float = defaults.TEMPERATURE
    top_k: int = defaults.TOP_K
    top_p: float = defaults.TOP_P
    max_tokens: int = defaults.MAX_TOKENS
    seed: int | None = None
    device: str = defaults.DEVICE
    dtype: str = defaults.DTYPE
    compile: str = defaults.COMPILE  # static caches + compiled steps: on for CUDA; on a CPU only where measured faster
    quantize: str = (
        defaults.QUANTIZE
    )  # int8 / int4 weight-only, w8a8 (int8 x int8, CPU); auto: measured (models.choose_quantize)
    tp: int = defaults.TP  # tensor-parallel ranks for the verifier (infer/tp/)
    backend: str = (
        defaults.BACKEND
    )  # torch, llama.cpp (GGUF files on a CPU), auto: llama.cpp where it can run (models.choose_backend)
    threads: int | None = None  # CPU threads for either backend (None: the CPUs this process may use)
    chat_template: bool | None = None  # None: use the tokenizer's chat template when it has one
    system: str | None = None
    stop: list[str] = field(default_factory=list)
    calibration: dict[str, Any] | None = None  # written by `cactus calibrate`

    def rule_kwargs(self) -> dict[str, Any]:
        """The validated parameters of ``self.rule`` (delta only for the rules that take it)."""
        spec = RULES.get(self.rule)
        if spec is None:
            raise ConfigError(f"unknown rule {self.rule!r}; choose one of: {', '.join(RULES)}")
        names = spec.param_names()
        kwargs = {k: v for k, v in self.rule_params.items() if k in names}
        if "delta" in names:
            kwargs["delta"] = self.delta
        try:
            return resolve_params(self.rule, kwargs)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _types(hint: Any) -> tuple[type, ...]:
    """The types a field's annotation admits (``float`` admits ints: 1 is written for 1.0)."""
    args = (
        typing.get_args(hint)
        if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        else (hint,)
    )
    out: list[type] = []
    for arg in args:
        base = typing.get_origin(arg) or arg  # dict[str, Any] -> dict
        out += [int, float] if base is float else [base]
    return tuple(dict.fromkeys(out))


_TYPES: dict[str, tuple[type, ...]] = {name: _types(hint) for name, hint in typing.get_type_hints(Settings).items()}
assert set(_TYPES) == {f.name for f in fields(Settings)}


def _type_name(types: tuple[type, ...]) -> str:
    names = {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "true/false",
        dict: "a mapping",
        list: "a list",
        type(None): "null",
    }
    return " or ".join(dict.fromkeys(names[t] for t in types if not (t is int and float in types)))


_CHOICES = {
    "dtype": DTYPES,
    "compile": COMPILE,
    "cross_vocab": CROSS_VOCAB,
    "quantize": QUANTIZE,
    "rule": RULES,
    "backend": BACKENDS,
}


_INT_RANGES = {
    "max_draft_tokens": (1, 64),
    "ngram_max": (1, 16),
    "ngram_min": (1, 16),
    "tp": (1, 64),
    "threads": (1, 1024),
}


def check_value(key: str, value: Any) -> str | None:
    """Why ``value`` is not valid for ``key``, or None. Types first, then ranges."""
    types = _TYPES[key]
    if isinstance(value, bool) and bool not in types:
        return f"must be {_type_name(types)}, got {value!r}"
    if not isinstance(value, types):
        return f"must be {_type_name(types)}, got {value!r}"
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    if key in _INT_RANGES and not _INT_RANGES[key][0] <= value <= _INT_RANGES[key][1]:
        return f"must be an integer in {_INT_RANGES[key][0]}..{_INT_RANGES[key][1]}, got {value!r}"
    if key == "delta" and not (math.isfinite(value) and 0 <= value <= MAX_DELTA):
        return f"must be a number in 0..{MAX_DELTA:g}, got {value!r}"
    if key == "num_draft_tokens" and (value != "auto" if isinstance(value, str) else not 1 <= value <= 64):
        return f"must be an integer in 1..64 or auto, got {value!r}"
    if key == "draft":
        for kind in LOOKUPS:
            if value.startswith(kind + "+") and not value[len(kind) + 1 :].strip():
                return f"{kind}+MODEL needs a model after the +, e.g. {kind}+embedded:qwen2.5-coder-0.5b"
    if key in ("remember", "history") and not value.strip():
        return "must be a file path"
    if key == "temperature" and not (math.isfinite(value) and (value == 0 or MIN_TEMPERATURE <= value <= 1e4)):
        return f"must be 0 (greedy) or a number in {MIN_TEMPERATURE:g}..1e4, got {value!r}"
    if key == "seed" and not 0 <= value <= MAX_SEED:
        return f"must be an integer in 0..2^63-1, got {value!r}"
    if key == "top_k" and value < 0:
        return f"must be an integer >= 0 (0 = off), got {value!r}"
    if key == "top_p" and not 0 < value <= 1:
        return f"must be a number in (0, 1], got {value!r}"
    if key == "max_tokens" and value < 1:
        return f"must be an integer >= 1, got {value!r}"
    if key == "device" and value not in DEVICES and not (value.startswith("cuda:") and value[5:].isdigit()):
        return f"must be one of {', '.join(DEVICES)} or cuda:N (N a GPU index), got {value!r}"
    if key in _CHOICES and value not in _CHOICES[key]:
        listed = (
            key in ("compile", "cross_vocab", "quantize", "backend") and "," in value
        )  # (bench and eval take lists)
        return f"must be one of {', '.join(_CHOICES[key])}, got {value!r}{_LISTS if listed else ''}"
    if key == "rule_params":
        unknown = sorted(set(value) - set(RULE_PARAM_KEYS))
        if unknown:
            return f"has unknown parameter {unknown[0]!r} (known: {', '.join(RULE_PARAM_KEYS)})"
        bad = next((n for n, v in value.items() if isinstance(v, float) and not math.isfinite(v)), None)
        if bad is not None:
            return f"{bad} must be a finite number, got {value[bad]!r}"
    if key == "stop" and not all(isinstance(s, str) and s for s in value):
        return "must be a list of non-empty strings"
    return None


def check_each(key: str, values: list[Any], flag: str) -> None:
    """Every value of a comma list (bench and calibrate sweep several) valid for ``key``."""
    for value in values:
        if problem := check_value(key, value):
            raise ConfigError(f"{flag}: each value {problem}")


FLAG_NAMES = {"rule_params": "--param", "num_draft_tokens": "-k/--num-draft-tokens"}


def check_layer(layer: dict[str, Any], origin: str, lines: dict[str, int] | None = None) -> None:
    """Every key known, every value valid; errors name the origin (and the line, for a file)
    and the key (or flag)."""
    for key, value in layer.items():
        if value is ...:
            continue
        where = f"{origin}:{lines.get(key, '?')}" if lines is not None else origin
        name = FLAG_NAMES.get(key, "--" + key.replace("_", "-")) if origin == "command line" else key
        if key not in _TYPES:
            raise ConfigError(f"{where}: unknown key {key!r} (known keys: {', '.join(_TYPES)})")
        problem = check_value(key, value)
        if problem:
            raise ConfigError(f"{where}: {name} {problem}")


def build_settings(*layers: tuple[dict[str, Any], str]) -> Settings:
    """Defaults, then each (layer, origin) in order, later winning. Values ``...`` are skipped."""
    merged: dict[str, Any] = {}
    for layer, origin in layers:
        check_layer(layer, origin)
        for key, value in layer.items():
            if value is ...:
                continue
            if key == "rule_params":
                merged[key] = {**merged.get(key, {}), **value}
            else:
                merged[key] = value
    if isinstance(merged.get("delta"), int):
        merged["delta"] = float(merged["delta"])
    settings = Settings(**merged)
    if settings.ngram_min > settings.ngram_max:
        raise ConfigError(f"ngram_min ({settings.ngram_min}) must not exceed ngram_max ({settings.ngram_max})")
    settings.rule_kwargs()  # validates the rule's parameters now, not mid-generation
    return settings


# --------------------------------------------------------------------------- parsing what users type


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


LOOKUPS = ("ngram", "suffix")  # drafting without a model: prompt lookup, the suffix trees


def uses_lookup(draft: str | None, kind: str | None = None) -> bool:
    """Whether a draft value drafts without a model first (``ngram``, ``suffix``, ``KIND+MODEL``);
    with ``kind``, by that one."""
    return draft is not None and parse_draft(draft)[0] in ((kind,) if kind else LOOKUPS)


def parse_draft(spec: str | None) -> tuple[str | None, str | None]:
    """A draft value: ``MODEL``; ``ngram`` (prompt lookup) or ``suffix`` (the suffix trees)
    alone; or ``ngram+MODEL`` / ``suffix+MODEL`` (the model drafts when they have nothing).
    Returns (the lookup kind or None, the model source or None)."""
    if spec is None:
        return None, None
    if spec in LOOKUPS:
        return spec, None
    for kind in LOOKUPS:
        if spec.startswith(kind + "+"):
            model = spec[len(kind) + 1 :].strip()
            if not model:
                raise ConfigError(
                    f"--draft {kind}+MODEL: name the draft model after the +, e.g. {kind}+embedded:qwen2.5-coder-0.5b"
                )
            return kind, model
    return None, spec


def parse_params(items: list[str] | None) -> dict[str, Any]:
    """--param KEY=VALUE pairs; values parsed as YAML scalars (numbers, strings)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--param {item!r}: expected KEY=VALUE, e.g. --param divergence=chi2")
        out[key.strip()] = parse_yaml(value, f"--param {key.strip()}")
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


def flags_to_settings(**flags: Any) -> dict[str, Any]:
    """Typed-in values (flags, lm-eval model_args) to Settings keys; None (not given) becomes
    ``...`` so the layers below show through."""
    out: dict[str, Any] = {k: (... if v is None else v) for k, v in flags.items()}
    if out.get("draft", ...) is not ... and str(out["draft"]).lower() == "none":
        out["draft"] = None
    if "rule_params" in out and out["rule_params"] is not ...:
        out["rule_params"] = parse_params(out["rule_params"]) or ...
    if out.get("stop") == []:
        out["stop"] = ...
    if isinstance(out.get("system"), str):
        out["system"] = clean_text(out["system"], "--system")
    if isinstance(out.get("stop"), list):
        out["stop"] = [clean_text(s, "--stop") for s in out["stop"]]
    if out.get("num_draft_tokens", ...) is not ...:
        out["num_draft_tokens"] = parse_k(out["num_draft_tokens"], "-k/--num-draft-tokens")
    return out


def check_flags_apply(settings: Settings, flags: dict[str, Any]) -> None:
    """A flag that would do nothing is an error, not a silent no-op."""
    takes = RULES[settings.rule].param_names()
    if flags.get("delta", ...) is not ... and "delta" not in takes:
        raise ConfigError(f"--delta has no effect with rule {settings.rule!r}; use --rule cactus or cactus-exact")
    for key in flags.get("rule_params") if flags.get("rule_params", ...) is not ... else {}:
        if key not in takes:
            raise ConfigError(
                f"--param {key}: rule {settings.rule!r} has no parameter {key!r} "
                f"(it takes: {', '.join(takes) or 'no parameters'})"
            )
    if settings.draft is None:
        for key, flag in (("num_draft_tokens", "-k/--num-draft-tokens"), ("max_draft_tokens", "--max-draft-tokens")):
            if flags.get(key, ...) is not ...:
                raise ConfigError(f"{flag} has no effect without a draft model; pass --draft")
    for key in ("ngram_max", "ngram_min"):
        if flags.get(key, ...) is not ... and not uses_lookup(settings.draft, "ngram"):
            raise ConfigError(f"--{key.replace('_', '-')} applies only to prompt lookup (--draft ngram or ngram+MODEL)")
    if flags.get("remember", ...) is not ... and not uses_lookup(settings.draft, "suffix"):
        raise ConfigError("--remember applies only to the suffix drafter (--draft suffix or suffix+MODEL)")
    if flags.get("cross_vocab", ...) is not ... and parse_draft(settings.draft)[1] is None:
        raise ConfigError(
            "--cross-vocab applies to a draft model with another tokenizer; "
            + (
                "pass --draft"
                if settings.draft is None
                else f"--draft {settings.draft} has no model (try {settings.draft}+MODEL)"
            )
        )
    if flags.get("max_draft_tokens", ...) is not ... and settings.num_draft_tokens != "auto":
        raise ConfigError("--max-draft-tokens only applies with -k auto")


def draft_limit(settings: Settings) -> int:
    """k for a fixed k, k_max for -k auto."""
    return settings.max_draft_tokens if settings.num_draft_tokens == "auto" else int(settings.num_draft_tokens)


def with_seed(settings: Settings) -> Settings:
    """A run without a seed still gets one, reported in --json, so any run can be replayed."""
    import secrets

    return settings if settings.seed is not None else replace(settings, seed=secrets.randbelow(2**31))
