"""Settings: the one place defaults live, YAML profiles, and precedence
(built-in defaults < profile file < command-line flags), resolved once.

A profile is a YAML mapping whose keys are the fields of ``Settings`` (see profiles/*.yaml).
Unknown keys and wrong types are errors naming the file, the line and the key.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from cactus_cli.errors import ConfigError

DEVICES = ("auto", "cpu", "cuda", "mps")
MAX_DELTA = 1e6  # nats; any budget this large already accepts every draft, and larger ones overflow float32
MIN_TEMPERATURE = 1e-3  # below this, logits / T overflows to inf and probabilities to NaN: use 0 (greedy)
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds; bench adds the prompt index
DTYPES = ("auto", "float32", "float16", "bfloat16")
COMPILE = ("auto", "on", "off")
QUANTIZE = ("auto", "none", "int8", "int4")
RULE_PARAM_KEYS = ("divergence", "epsilon", "alpha", "topk")  # rule parameters other than delta


@dataclass
class Settings:
    """Everything a run needs besides the prompt. Field defaults are the built-in defaults."""

    description: str = ""
    verifier: str | None = None  # model source: hub id, local folder, .gguf file, or "embedded:NAME"
    draft: str | None = None  # None: the verifier alone (autoregressive)
    tokenizer: str | None = None  # tokenizer source for both models (default: the verifier's)
    rule: str = "cactus"
    delta: float = 1.0  # divergence budget, for cactus and cactus-exact
    rule_params: dict[str, Any] = field(default_factory=dict)  # divergence, epsilon, alpha, topk
    num_draft_tokens: int | str = 4  # k, or "auto": the engine picks k in 0..max_draft_tokens per step
    max_draft_tokens: int = 8  # k_max for num_draft_tokens: auto
    ngram_max: int = 4  # prompt lookup (draft: ngram or ngram+MODEL): the longest n-gram matched ...
    ngram_min: int = 1  # ... and the shortest
    temperature: float = 0.6
    top_k: int = 20
    top_p: float = 0.95
    max_tokens: int = 256
    seed: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    compile: str = "auto"  # static caches + compiled steps: on for CUDA; on a CPU only where measured faster
    quantize: str = "none"  # weight-only int8 / int4 Linear layers; auto: int8 on a CPU, none on a GPU
    tp: int = 1  # tensor-parallel ranks for the verifier (distributed.py)
    chat_template: bool | None = None  # None: use the tokenizer's chat template when it has one
    system: str | None = None
    stop: list[str] = field(default_factory=list)
    calibration: dict[str, Any] | None = None  # written by `cactus calibrate`

    def rule_kwargs(self) -> dict[str, Any]:
        """The validated parameters of ``self.rule`` (delta only for the rules that take it)."""
        from cactus_cli.acceptance import RULES, resolve_params

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


_TYPES: dict[str, tuple[type, ...]] = {
    "description": (str,),
    "verifier": (str, type(None)),
    "draft": (str, type(None)),
    "tokenizer": (str, type(None)),
    "rule": (str,),
    "delta": (int, float),
    "rule_params": (dict,),
    "num_draft_tokens": (int, str),
    "max_draft_tokens": (int,),
    "ngram_max": (int,),
    "ngram_min": (int,),
    "temperature": (int, float),
    "top_k": (int,),
    "top_p": (int, float),
    "max_tokens": (int,),
    "seed": (int, type(None)),
    "device": (str,),
    "dtype": (str,),
    "compile": (str,),
    "quantize": (str,),
    "tp": (int,),
    "chat_template": (bool, type(None)),
    "system": (str, type(None)),
    "stop": (list,),
    "calibration": (dict, type(None)),
}
assert set(_TYPES) == {f.name for f in fields(Settings)}


def _type_name(types: tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true/false", dict: "a mapping",
             list: "a list", type(None): "null"}
    return " or ".join(dict.fromkeys(names[t] for t in types if not (t is int and float in types)))


def check_value(key: str, value: Any) -> str | None:
    """Why ``value`` is not valid for ``key``, or None. Types first, then ranges."""
    types = _TYPES[key]
    if isinstance(value, bool) and bool not in types:
        return f"must be {_type_name(types)}, got {value!r}"
    if not isinstance(value, types):
        return f"must be {_type_name(types)}, got {value!r}"
    if value is None:
        return None
    if key == "delta" and not (math.isfinite(value) and 0 <= value <= MAX_DELTA):
        return f"must be a number in 0..{MAX_DELTA:g}, got {value!r}"
    if key == "num_draft_tokens" and (value != "auto" if isinstance(value, str) else not 1 <= value <= 64):
        return f"must be an integer in 1..64 or auto, got {value!r}"
    if key == "max_draft_tokens" and not 1 <= value <= 64:
        return f"must be an integer in 1..64, got {value!r}"
    if key in ("ngram_max", "ngram_min") and not 1 <= value <= 16:
        return f"must be an integer in 1..16, got {value!r}"
    if key == "draft" and value.startswith("ngram+") and not value[len("ngram+"):].strip():
        return "ngram+MODEL needs a model after the +, e.g. ngram+embedded:qwen2.5-coder-0.5b"
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
    if key == "dtype" and value not in DTYPES:
        return f"must be one of {', '.join(DTYPES)}, got {value!r}"
    if key == "compile" and value not in COMPILE:
        return f"must be one of {', '.join(COMPILE)}, got {value!r}"
    if key == "tp" and not 1 <= value <= 64:
        return f"must be an integer in 1..64, got {value!r}"
    if key == "quantize" and value not in QUANTIZE:
        return f"must be one of {', '.join(QUANTIZE)}, got {value!r}"
    if key == "rule":
        from cactus_cli.acceptance import RULES

        if value not in RULES:
            return f"must be one of {', '.join(RULES)}, got {value!r}"
    if key == "rule_params":
        unknown = sorted(set(value) - set(RULE_PARAM_KEYS))
        if unknown:
            return f"has unknown parameter {unknown[0]!r} (known: {', '.join(RULE_PARAM_KEYS)})"
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
    settings = Settings(**merged)
    if settings.ngram_min > settings.ngram_max:
        raise ConfigError(f"ngram_min ({settings.ngram_min}) must not exceed ngram_max ({settings.ngram_max})")
    if isinstance(settings.delta, int):
        settings.delta = float(settings.delta)
    settings.rule_kwargs()  # validates the rule's parameters now, not mid-generation
    return settings


# --------------------------------------------------------------------------- profiles


def cactus_home() -> Path | None:
    home = os.environ.get("CACTUS_HOME")
    return Path(home).expanduser() if home else None


def user_profile_dir() -> Path:
    home = cactus_home()
    return home / "profiles" if home else Path("~/.config/cactus/profiles").expanduser()


def builtin_profile_dir() -> Path:
    """profiles/ beside the package in a checkout; share/cactus/profiles in an installed wheel."""
    here = Path(__file__).resolve().parent.parent / "profiles"
    if here.is_dir():
        return here
    return Path(sys.prefix) / "share" / "cactus" / "profiles"


def list_profiles() -> list[tuple[str, Path, str]]:
    """(name, path, origin) for every profile; a user profile shadows a built-in of the same name."""
    found: dict[str, tuple[str, Path, str]] = {}
    for origin, folder in (("built-in", builtin_profile_dir()), ("user", user_profile_dir())):
        if folder.is_dir():
            for path in sorted(folder.glob("*.yaml")):
                found[path.stem] = (path.stem, path, origin)
    return sorted(found.values())


def find_profile(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        raise ConfigError(f"profile {name_or_path} is a directory; give a profile name or a .yaml file")
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not path.is_file():
            raise ConfigError(f"profile file {name_or_path} does not exist")
        return path
    for name, p, _ in list_profiles():
        if name == name_or_path:
            return p
    names = ", ".join(n for n, _, _ in list_profiles()) or "none"
    raise ConfigError(
        f"unknown profile {name_or_path!r} (available: {names}; user profiles live in {user_profile_dir()})"
    )


def load_profile(name_or_path: str) -> tuple[dict[str, Any], Path]:
    """Read and check a profile file: a mapping of known keys with valid values, nothing else."""
    import yaml

    from cactus_cli.fileio import read_utf8_file

    path = find_profile(name_or_path)
    try:
        text = read_utf8_file(path, "the profile")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the profile ({err.strerror or err})") from None
    data = parse_yaml(text, str(path))
    node = yaml.compose(text)  # (valid and alias-free by now) for the line of each key
    if data is None:
        return {}, path
    if not isinstance(data, dict) or node is None:
        raise ConfigError(f"{path}: a profile must be a YAML mapping of settings")
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value if hasattr(k, "value")}
    check_layer(data, str(path), lines)
    check_profile_keys(data, str(path), lines)
    return data, path


def parse_yaml(text: str, where: str) -> Any:
    """``yaml.safe_load`` for what users write (profiles, --param, /set), with every failure one
    ConfigError line naming ``where``. Aliases are refused before anything is built: a few
    hundred bytes of nested aliases expand to 10^8 entries when the result is walked."""
    import yaml

    try:
        for event in yaml.parse(text):  # events only: nothing is expanded yet
            if isinstance(event, yaml.AliasEvent):
                raise ConfigError(f"{where}:{event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not "
                                  "allowed here; write the value out")
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())
        raise ConfigError(f"{where}{line}: not valid YAML ({problem})") from None
    except RecursionError:
        raise ConfigError(f"{where}: YAML nested too deeply") from None


def uses_lookup(draft: str | None) -> bool:
    """Whether a draft value drafts by prompt lookup (``ngram`` or ``ngram+MODEL``)."""
    return draft is not None and (draft == "ngram" or draft.startswith("ngram+"))


def check_profile_keys(data: dict[str, Any], origin: str, lines: dict[str, int]) -> None:
    """Keys of one profile that would do nothing with the profile's other keys: an error."""
    draft = data.get("draft")
    if isinstance(draft, str) and not uses_lookup(draft):
        for key in ("ngram_max", "ngram_min"):
            if key in data:
                raise ConfigError(f"{origin}:{lines.get(key, '?')}: {key} applies only to prompt lookup "
                                  f"(draft: ngram or ngram+MODEL), not to draft {draft!r}; remove it")
    if "max_draft_tokens" in data and isinstance(data.get("num_draft_tokens"), int):
        raise ConfigError(f"{origin}:{lines.get('max_draft_tokens', '?')}: max_draft_tokens applies only with "
                          f"num_draft_tokens: auto (this profile fixes k = {data['num_draft_tokens']}); remove one")


def resolve_settings(profile: str | None, flags: dict[str, Any]) -> Settings:
    """Built-in defaults < profile (``default`` when none is named and it exists) < flags.
    ``flags`` maps Settings keys to values; ``...`` (Ellipsis) means not given."""
    layers: list[tuple[dict[str, Any], str]] = []
    name = profile
    if name is None and any(n == "default" for n, _, _ in list_profiles()):
        name = "default"
    if name is not None:
        data, path = load_profile(name)
        layers.append((data, str(path)))
    layers.append((flags, "command line"))
    return build_settings(*layers)
