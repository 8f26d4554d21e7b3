"""Profiles: YAML files of settings (profiles/*.yaml built in, user ones in
``$CACTUS_HOME/profiles`` or ``~/.config/cactus/profiles``), and precedence: built-in defaults <
profile file < command-line flags, resolved once. A profile is a YAML mapping whose keys are the
fields of ``Settings``; unknown keys and wrong types are errors naming the file, the line and the key.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from cactus_cli.app.config.parsing import parse_yaml
from cactus_cli.app.config.settings import Settings, build_settings, check_layer, inert_rule_param, kind_setting_problem
from cactus_cli.core import defaults
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.fileio import read_utf8_file
from cactus_cli.core.paths import cactus_home


def user_profile_dir() -> Path:
    home = cactus_home()
    return home / "profiles" if home else Path("~/.config/cactus/profiles").expanduser()


def builtin_profile_dir() -> Path:
    """profiles/ beside the package in a checkout; share/cactus/profiles in an installed wheel."""
    here = Path(__file__).resolve().parents[3] / "profiles"  # (cactus_cli/app/config/ -> the checkout)
    if here.is_dir():
        return here
    return Path(sys.prefix) / "share" / "cactus" / "profiles"


def list_profiles() -> list[tuple[str, Path, str]]:
    """(name, path, origin) for every profile; a user profile shadows a built-in of the same name."""
    found: dict[str, tuple[str, Path, str]] = {}
    for origin, folder in (("built-in", builtin_profile_dir()), ("user", user_profile_dir())):
        if folder.is_dir():
            for path in sorted(folder.glob("*.yaml")):
                if path.is_file():  # (a FIFO or a device there is no profile: reading it would block)
                    found[path.stem] = (path.stem, path, origin)
    return sorted(found.values())


def find_profile(name_or_path: str) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        raise ConfigError(f"profile {name_or_path} is a directory; give a profile name or a .yaml file")
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if path.exists() and not path.is_file():
            raise ConfigError(f"profile {name_or_path} is not a regular file (a device or FIFO); give a .yaml file")
        if not path.is_file():
            raise ConfigError(f"profile file {name_or_path} does not exist")
        return path
    for name, p, _ in list_profiles():
        if name == name_or_path:
            return p
    odd = user_profile_dir() / f"{name_or_path}.yaml"
    if odd.exists() and not odd.is_file():
        raise ConfigError(f"profile {name_or_path}: {odd} is not a regular file (a device or FIFO); remove it")
    names = ", ".join(n for n, _, _ in list_profiles()) or "none"
    raise ConfigError(
        f"unknown profile {name_or_path!r} (available: {names}; user profiles live in {user_profile_dir()})"
    )


def load_profile(name_or_path: str) -> tuple[dict[str, Any], Path]:
    """Read and check a profile file: a mapping of known keys with valid values, nothing else."""
    import yaml

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
    check_unique_keys(node, path)
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value if hasattr(k, "value")}
    check_layer(data, str(path), lines)
    check_profile_keys(data, str(path), lines)
    return data, path


def check_unique_keys(node: Any, path: Path) -> None:
    """A key given twice in any mapping of the file is an error (YAML silently keeps the last: a
    profile edited twice over would run with a value its reader did not see)."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        first: dict[Any, int] = {}
        for key, value in node.value:
            name = getattr(key, "value", None)
            if isinstance(name, str) and name in first:
                raise ConfigError(
                    f"{path}:{key.start_mark.line + 1}: {name!r} is given twice (first at line {first[name]}); keep one"
                )
            first[name] = key.start_mark.line + 1
            check_unique_keys(value, path)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            check_unique_keys(item, path)


def check_profile_keys(data: dict[str, Any], origin: str, lines: dict[str, int]) -> None:
    """Keys of one profile that would do nothing with the profile's other keys: an error."""
    draft = data.get("draft")
    given = {k: v for k, v in data.items() if v is not None}
    if isinstance(draft, str) and (problem := kind_setting_problem(draft, given)):
        key, owners = problem
        raise ConfigError(
            f"{origin}:{lines.get(key, '?')}: {key} applies only to {owners}, not to draft {draft!r}; remove it"
        )
    rule = data.get("rule") or defaults.RULE
    if inert := inert_rule_param(rule, data):
        key, rules = inert
        whose = (
            f"rule {rule!r}" if data.get("rule") else f"rule {rule!r} (the built-in default: the profile names no rule)"
        )
        raise ConfigError(
            f"{origin}:{lines.get(key, lines.get('rule_params', '?'))}: {key} has no effect with {whose}; "
            f"add rule: {' or '.join(rules)}, or remove {key}"
        )
    if "max_draft_tokens" in data and isinstance(data.get("num_draft_tokens"), int):
        raise ConfigError(
            f"{origin}:{lines.get('max_draft_tokens', '?')}: max_draft_tokens applies only with "
            f"num_draft_tokens: auto (this profile fixes k = {data['num_draft_tokens']}); remove one"
        )


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
