"""What `cactus calibrate --save` writes: the chosen delta and k, and a calibration block, into a
YAML profile (a user profile by name, or a file by path; never a built-in), every other key kept."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from cactus_cli.app.config.profile_files import (
    builtin_profile_dir,
    find_profile,
    list_profiles,
    load_profile,
    user_profile_dir,
)
from cactus_cli.app.config.settings import Settings, rule_param_specs
from cactus_cli.core.acceptance import RULES
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.fileio import check_output_file, write_or_fail


def save_target(name_or_path: str) -> Path:
    """NAME -> the user profile folder; anything path-like -> that file. Never a built-in."""
    looks_like_path = name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path
    path = Path(name_or_path).expanduser() if looks_like_path else user_profile_dir() / f"{name_or_path}.yaml"
    if path.resolve().parent == builtin_profile_dir().resolve():
        raise ConfigError(
            f"--save: {path} is a built-in profile; save under another name (it goes to {user_profile_dir()})"
        )
    if not looks_like_path and not name_or_path.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"--save: {name_or_path!r} is not a usable profile name (letters, digits, - _ .)")
    builtin = builtin_profile_dir() / f"{name_or_path}.yaml"
    if not looks_like_path and builtin.is_file() and not path.exists():
        bare = " and every command that names no profile" if name_or_path == "default" else ""
        raise ConfigError(
            f"--save: {name_or_path!r} is a built-in profile's name; a user profile of that name would replace it "
            f"for `--profile {name_or_path}`{bare}; save under another name"
        )
    return path


def check_save_target(target: Path) -> None:
    """Before the run: the user profile folder is created when missing (saving there is what
    --save NAME asks for); any other path must be a writable file in an existing folder."""

    if target.parent == user_profile_dir():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(
                f"--save: cannot create the profile folder {target.parent} ({err.strerror or err})"
            ) from None
    check_output_file(target, "--save")
    if target.is_file():
        load_profile(str(target))  # its other keys are kept: it must be a valid profile


def save_profile(target: Path, base_profile: str | None, settings: Settings, doc: dict[str, Any]) -> Path:
    """Write the chosen delta and k and a calibration block, keeping every other key of the
    target (or, for a new file, of the profile the run used). Atomic: temp file + rename."""
    import yaml

    data: dict[str, Any] = {}
    source = (
        target
        if target.is_file()
        else find_profile(base_profile or "default")
        if (base_profile or any(n == "default" for n, _, _ in list_profiles()))
        else None
    )
    if source is not None:
        loaded, _ = load_profile(str(source))  # a broken file is an error naming it, never overwritten
        data.update(loaded)
    # what this calibration ran with: the pair and the sampling it is valid for. A description
    # written for another pair would now be wrong: replace it.
    if any(getattr(settings, key) != data.get(key) for key in ("verifier", "draft")):
        data["description"] = f"calibrated for {settings.verifier} / {settings.draft}"
    for key in ("verifier", "draft", "tokenizer", "device", "dtype", "temperature", "top_k", "top_p", "rule_params"):
        value = getattr(settings, key)
        if value != data.get(key) and value not in (None, {}):
            data[key] = value
    if doc["chosen"]["delta"] == 0:  # delta = 0 is SpS: say so, rather than a rule that does nothing
        data["rule"] = "sps"
    else:
        data["rule"] = doc["rule"]
        data["delta"] = float(doc["chosen"]["delta"])
    takes = RULES[data["rule"]].param_names()  # the swept rule's other parameters under SpS: refused at load
    for name in rule_param_specs():
        if name not in takes:
            data.pop(name, None)
    params = {k: v for k, v in (data.pop("rule_params", None) or {}).items() if k in takes}
    if params:
        data["rule_params"] = params
    k = doc["chosen"]["num_draft_tokens"]
    data["num_draft_tokens"] = k if k == "auto" else int(k)
    if k == "auto":
        data["max_draft_tokens"] = int(settings.max_draft_tokens)
    else:  # (the source profile's, for its -k auto: invalid beside a fixed k)
        data.pop("max_draft_tokens", None)
    chosen_row = next(r for r in doc["delta_sweep"]["rows"] if r["delta"] == doc["chosen"]["delta"])
    k_row = next(r for r in doc["k_sweep"]["rows"] if r["k"] == doc["chosen"]["num_draft_tokens"])
    data["calibration"] = {
        "date": time.strftime("%Y-%m-%d"),
        "prompts": len(doc["prompts"]),
        "constraints": doc["constraints"],
        "reason": doc["chosen"]["reason"],
        "acceptance_rate": chosen_row["acceptance_rate"],
        "per_token_acceptance": chosen_row["per_token_acceptance"],
        "realized_kl_mean": chosen_row["realized_kl_mean"],
        "loglik_vs_sps": chosen_row["loglik_vs_sps"],
        "tokens_per_second": k_row["tokens_per_second"],
        "cost_ratio": doc["k_sweep"]["cost_ratio"],
        "verifier_alone_tokens_per_second": doc["k_sweep"]["verifier_alone_tokens_per_second"],
        "temperature": settings.temperature,
        "top_k": settings.top_k,
        "top_p": settings.top_p,
    }
    env = doc.get("environment") or {}
    if env.get("device_name"):  # the machine its timings are true of (a start elsewhere says so: runtime.py)
        data["calibration"]["machine"] = env["device_name"]
        data["calibration"]["threads"] = env.get("llama_cpp_threads") or env.get("cpu_threads")
    text = "# written by `cactus calibrate`; other keys kept as they were\n" + yaml.safe_dump(data, sort_keys=False)
    return write_or_fail(target, text, "--save")
