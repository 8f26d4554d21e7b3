"""Settings: everything a run needs besides the prompt (defaults from core/defaults.py), and the
checks every value passes wherever it comes from (a profile, a flag, chat's /set, lm-eval's
model_args). What users type is parsed in parsing.py. Settings are frozen: change one with
``dataclasses.replace``.
"""

from __future__ import annotations

import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from cactus_cli.app.config.parsing import parse_draft, parse_k, parse_params
from cactus_cli.core import defaults
from cactus_cli.core.acceptance import RULES, resolve_params
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.fileio import clean_text
from cactus_cli.infer.backends import registry
from cactus_cli.infer.draft import KINDS, param_specs

DEVICES = ("auto", "cpu", "cuda", "mps")
MIN_TEMPERATURE = 1e-3  # below this, logits / T overflows to inf and probabilities to NaN: use 0 (greedy)
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds; bench adds the prompt index
DTYPES = ("auto", "float32", "float16", "bfloat16")
COMPILE = ("auto", "on", "off")
QUANTIZE = ("auto", "none", *dict.fromkeys(q for b in registry.BACKENDS.values() for q in b.quantizations))
CROSS_VOCAB = ("auto", "string", "intersection")
_LISTS = " (a comma list is for bench and eval, to compare several in one run)"


class InertParam(ConfigError):
    """A rule parameter a request gave that its rule does not take (``param``: which; a 400)."""

    def __init__(self, param: str, rule: str, rules: list[str]):
        super().__init__(f"{param} has no effect with rule {rule!r}; use rule {' or '.join(rules)}")
        self.param = param


@dataclass(frozen=True)
class Settings:
    """Everything a run needs besides the prompt. Field defaults are the built-in defaults."""

    description: str = ""
    verifier: str | None = None  # model source: hub id, local folder, .gguf file, or "embedded:NAME"
    draft: str | None = None  # None: the verifier alone (autoregressive)
    tokenizer: str | None = None  # tokenizer source for both models (default: the verifier's)
    cross_vocab: str = defaults.CROSS_VOCAB  # a draft with another tokenizer: string (SLEM), intersection (TLI), auto
    rule: str = defaults.RULE
    rule_params: dict[str, Any] = field(default_factory=dict)  # the rules' parameters (RULES): delta, divergence, ...
    num_draft_tokens: int | str = (
        defaults.NUM_DRAFT_TOKENS
    )  # k, or "auto": the engine picks k in 0..max_draft_tokens per step
    max_draft_tokens: int = defaults.MAX_DRAFT_TOKENS  # k_max for num_draft_tokens: auto
    draft_params: dict[str, Any] = field(default_factory=dict)  # the model-free drafters' own (KINDS): ngram_max, ...
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
    tp: int = defaults.TP  # tensor-parallel ranks for the verifier (infer/backends/torch/group.py)
    backend: str = (
        defaults.BACKEND
    )  # torch, llama.cpp (GGUF files on a CPU), auto: the first of registry.BACKENDS that runs the models
    threads: int | None = None  # CPU threads for either backend (None: the CPUs this process may use)
    chat_template: bool | None = None  # None: use the tokenizer's chat template when it has one
    system: str | None = None
    stop: list[str] = field(default_factory=list)
    calibration: dict[str, Any] | None = None  # written by `cactus calibrate`

    def rule_kwargs(self, given: dict[str, Any] | None = None) -> dict[str, Any]:
        """The validated parameters of ``self.rule`` (the others' are kept, for another rule).
        ``given``: the keys a request gave (Settings keys): a rule parameter among them that the
        rule does not take is an ``InertParam``, never a silent no-op."""
        asked = gather_params(given).get("rule_params", {}) if given else {}
        spec = RULES.get(self.rule)
        if spec is None:
            raise ConfigError(f"unknown rule {self.rule!r}; choose one of: {', '.join(RULES)}")
        for key in asked if isinstance(asked, dict) else {}:
            if key not in spec.param_names():
                raise InertParam(key, self.rule, [name for name, r in RULES.items() if key in r.param_names()])
        kwargs = {k: v for k, v in self.rule_params.items() if k in spec.param_names()}
        try:
            return resolve_params(self.rule, kwargs)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def param(self, name: str) -> Any:
        """A rule parameter as set, else its default (``settings.param("delta")``)."""
        return self.rule_params.get(name, rule_param_specs()[name].default)

    def draft_param(self, name: str) -> Any:
        """A drafter parameter as set, else its default (``settings.draft_param("remember")``)."""
        return self.draft_params.get(name, param_specs()[name].default)

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


def rule_param_specs() -> dict[str, Any]:
    """Every parameter of every registered rule by name (``core.acceptance.Param``: default,
    validity, type): what a profile key, ``--param`` and ``--delta`` may set. Read from RULES each
    time, so a rule registered later (a plugin, a test's toy rule) brings its own parameters."""
    out: dict[str, Any] = {}
    for rule in RULES.values():
        for prm in rule.params:
            out.setdefault(prm.name, prm)
    return out


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
    "backend": registry.CHOICES,
}


_INT_RANGES = {
    "max_draft_tokens": (1, 64),
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
    if key == "num_draft_tokens" and (value != "auto" if isinstance(value, str) else not 1 <= value <= 64):
        return f"must be an integer in 1..64 or auto, got {value!r}"
    if key == "draft":
        for kind in KINDS:
            if value.startswith(kind + "+") and not value[len(kind) + 1 :].strip():
                return f"{kind}+MODEL needs a model after the +, e.g. {kind}+embedded:qwen2.5-coder-0.5b"
    if key == "history" and not value.strip():
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
        return _params_problem(value, rule_param_specs())
    if key == "draft_params":
        return _params_problem(value, param_specs())
    if key == "stop" and not all(isinstance(s, str) and s for s in value):
        return "must be a list of non-empty strings"
    return None


def check_rule_param(name: str, value: Any) -> str | None:
    """Why ``value`` is not valid for the rule parameter ``name`` (the rule's own check: the rule
    a run uses checks it again with its own range), or None."""
    return _check_param(rule_param_specs()[name], value)


def _params_problem(value: dict[str, Any], specs: dict[str, Any]) -> str | None:
    """Why a mapping of parameters (a rule's or a drafter's: ``specs``) is not valid, or None."""
    unknown = sorted(set(value) - set(specs))
    if unknown:
        return f"has unknown parameter {unknown[0]!r} (known: {', '.join(specs) or 'none'})"
    for name, v in value.items():
        if problem := _check_param(specs[name], v):
            return f"{name} {problem}"
    return None


def check_draft_param(name: str, value: Any) -> str | None:
    """Why ``value`` is not valid for the drafter parameter ``name``, or None."""
    return _check_param(param_specs()[name], value)


def _check_param(spec: Any, value: Any) -> str | None:
    if value is None and spec.default is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value!r}"
    return None if spec.valid(value) else f"must be {spec.valid_range}, got {value!r}"


def check_each(key: str, values: list[Any], flag: str) -> None:
    """Every value of a comma list (bench and calibrate sweep several) valid for ``key``."""
    for value in values:
        problem = check_rule_param(key, value) if key in rule_param_specs() else check_value(key, value)
        if problem:
            raise ConfigError(f"{flag}: each value {problem}")


FLAG_NAMES = {
    "rule_params": "--param",
    "draft_params": "--draft-param",
    "num_draft_tokens": "-k/--num-draft-tokens",
    "delta": "--delta",  # (a rule parameter with a flag of its own ...)
    "remember": "--remember",  # (... and a drafter parameter)
}


def flag_name(key: str) -> str:
    """How the command line spells a setting or parameter (``--delta``, ``--param KEY``,
    ``--draft-param KEY``)."""
    if key in FLAG_NAMES:
        return FLAG_NAMES[key]
    if key in _TYPES:
        return "--" + key.replace("_", "-")
    return f"--param {key}" if key in rule_param_specs() else f"--draft-param {key}"


def _check_key(key: str, value: Any) -> str | None:
    """A setting's, a rule parameter's or a drafter parameter's check, whichever ``key`` is."""
    if key in _TYPES:
        return check_value(key, value)
    return check_rule_param(key, value) if key in rule_param_specs() else check_draft_param(key, value)


def check_layer(layer: dict[str, Any], origin: str, lines: dict[str, int] | None = None) -> None:
    """Every key known (a setting, or a rule parameter: ``delta: 0.5`` in a profile), every
    value valid; errors name the origin (and the line, for a file) and the key (or flag)."""
    specs = {**rule_param_specs(), **param_specs()}
    for key, value in layer.items():
        if value is ...:
            continue
        where = f"{origin}:{lines.get(key, '?')}" if lines is not None else origin
        name = flag_name(key) if origin == "command line" else key
        if key not in _TYPES and key not in specs:
            known = ", ".join([*_TYPES, *specs])
            raise ConfigError(f"{where}: unknown key {key!r} (known keys: {known})")
        problem = _check_key(key, value)
        if problem:
            raise ConfigError(f"{where}: {name} {problem}")


def gather_params(layer: dict[str, Any]) -> dict[str, Any]:
    """A layer with its rule parameters given as keys (``delta: 0.5``, ``--delta``) moved into
    ``rule_params``, and its drafter parameters (``ngram_max: 3``, ``--remember``) into
    ``draft_params``, where each lives."""
    out = layer
    for field_name, specs in (("rule_params", rule_param_specs()), ("draft_params", param_specs())):
        params = {k: v for k, v in out.items() if k in specs and k not in _TYPES and v is not ...}
        if params:
            out = {k: v for k, v in out.items() if k not in params}
            given = out.get(field_name, ...)
            out[field_name] = {**(given if isinstance(given, dict) else {}), **params}
    return out


def build_settings(*layers: tuple[dict[str, Any], str]) -> Settings:
    """Defaults, then each (layer, origin) in order, later winning. Values ``...`` are skipped."""
    merged: dict[str, Any] = {}
    specs = rule_param_specs()
    for layer, origin in layers:
        check_layer(layer, origin)
        for key, value in gather_params(layer).items():
            if value is ...:
                continue
            if key == "rule_params":
                value = {n: float(v) if specs[n].kind is float and type(v) is int else v for n, v in value.items()}
                merged[key] = {**merged.get(key, {}), **value}
            elif key == "draft_params":
                merged[key] = {**merged.get(key, {}), **value}
            else:
                merged[key] = value
    settings = Settings(**merged)
    for kind in KINDS.values():  # (checks across a drafter's parameters: ngram_min <= ngram_max)
        try:
            kind.resolve(settings.draft_params)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    settings.rule_kwargs()  # validates the rule's parameters now, not mid-generation
    return settings


def kind_setting_problem(draft: str | None, given: dict[str, Any]) -> tuple[str, str] | None:
    """(a drafter parameter, the drafters that take it, in words) among the keys of ``given`` (and
    of its ``draft_params``) that ``draft`` would not read."""
    used = parse_draft(draft)[0] if draft is not None else None
    nested = given.get("draft_params", ...)
    keys = [k for k, v in given.items() if v is not ...] + list(nested if isinstance(nested, dict) else {})
    for key in param_specs():
        owners = [kind for kind in KINDS.values() if key in [p.name for p in kind.params]]
        if key in keys and used not in [kind.name for kind in owners]:
            return key, " or ".join(f"{k.summary} (draft {k.name} or {k.name}+MODEL)" for k in owners)
    return None


def flags_to_settings(**flags: Any) -> dict[str, Any]:
    """Typed-in values (flags, lm-eval model_args) to Settings keys; None (not given) becomes
    ``...`` so the layers below show through."""
    out: dict[str, Any] = {k: (... if v is None else v) for k, v in flags.items()}
    if out.get("draft", ...) is not ... and str(out["draft"]).lower() == "none":
        out["draft"] = None
    for key, flag in (("rule_params", "--param"), ("draft_params", "--draft-param")):
        if key in out and out[key] is not ...:
            out[key] = parse_params(out[key], flag) or ...
    if out.get("stop") == []:
        out["stop"] = ...
    if isinstance(out.get("system"), str):
        out["system"] = clean_text(out["system"], "--system")
    if isinstance(out.get("stop"), list):
        out["stop"] = [clean_text(s, "--stop") for s in out["stop"]]
    if out.get("num_draft_tokens", ...) is not ...:
        out["num_draft_tokens"] = parse_k(out["num_draft_tokens"], "-k/--num-draft-tokens")
    return out


def inert_rule_param(rule: str, given: dict[str, Any]) -> tuple[str, list[str]] | None:
    """The first rule parameter in ``given`` (keys as flags or a request name them) that ``rule``
    does not take, with the rules that do; None when each one given has an effect."""
    takes = RULES[rule].param_names()
    params = gather_params(given).get("rule_params", ...)
    for key in params if params is not ... else {}:
        if key not in takes:
            return key, [name for name, r in RULES.items() if key in r.param_names()]
    return None


def check_flags_apply(settings: Settings, flags: dict[str, Any]) -> None:
    """A flag that would do nothing is an error, not a silent no-op."""
    if inert := inert_rule_param(settings.rule, flags):
        takes = RULES[settings.rule].param_names()
        raise ConfigError(
            f"{flag_name(inert[0])} has no effect with rule {settings.rule!r} (it takes: "
            f"{', '.join(takes) or 'no parameters'}); use --rule {' or '.join(inert[1])}"
        )
    if settings.draft is None:
        for key, flag in (("num_draft_tokens", "-k/--num-draft-tokens"), ("max_draft_tokens", "--max-draft-tokens")):
            if flags.get(key, ...) is not ...:
                raise ConfigError(f"{flag} has no effect without a draft model; pass --draft")
    if problem := kind_setting_problem(settings.draft, flags):
        raise ConfigError(f"{flag_name(problem[0])} applies only to {problem[1]}")
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
