"""Choosing delta and k from measurements (no Rich here).

1. Sweep delta at the profile's k with the divergence meter on: per-token acceptance `a`,
   accepted tokens per step, the realized KL(h_alg || q) per position, and the verifier
   log-likelihood of the generated tokens relative to SpS (delta = 0 is always in the sweep).
2. Choose the largest delta whose mean realized KL is within --max-divergence (and whose
   log-likelihood drop is within --max-quality-drop, when given).
3. Measure the draft/verifier cost ratio `c`, rank k by the cost model
   (1 - a^(k+1)) / ((1 - a)(1 + k c)) with the chosen delta's `a`, and time only the best few
   (meter off), choosing the k with the highest measured tokens/s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from cactus_cli.bench import BenchConfig, ConfigResult, run_speculative
from cactus_cli.config import Settings, builtin_profile_dir, find_profile, list_profiles, user_profile_dir
from cactus_cli.errors import ConfigError

DEFAULT_DELTAS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
DEFAULT_KS = tuple(range(1, 13))
# Mean realized KL(h_alg || q) per emitted position, in nats. See README "Calibrate": 0.05 nats
# keeps the emitted distribution within TV <= sqrt(0.05 / 2) ~ 0.16 of the verifier (Pinsker),
# per token, and sits below what the paper's delta = 1 realizes on the embedded pair.
DEFAULT_MAX_DIVERGENCE = 0.05
KEEP_K = 3  # how many k the cost model lets through to be timed


def predicted_speedup(a: float, k: int, c: float) -> float:
    """Expected tokens per verifier call over the cost of a step (Leviathan et al. 2023)."""
    a = min(max(a, 0.0), 1.0 - 1e-9)
    return (1 - a ** (k + 1)) / ((1 - a) * (1 + k * c))


def cost_ratio(result: ConfigResult) -> float:
    """Draft cost per token relative to one verifier forward, from the timings of a run."""
    s = result.stats
    steps = max(s.num_steps, 1)
    drafts = max(s.num_draft_tokens, 1)
    return (s.draft_seconds / drafts) / max(s.verify_seconds / steps, 1e-12)


@dataclass
class DeltaPoint:
    delta: float
    result: ConfigResult

    def row(self, ref_loglik: float | None) -> dict[str, Any]:
        m = self.result.metrics()
        ll = m["mean_verifier_loglik"]
        return {"delta": self.delta, "acceptance_rate": m["draft_acceptance_rate"],
                "per_token_acceptance": m["per_token_acceptance"],
                "mean_accepted_tokens_per_step": m["mean_accepted_tokens_per_step"],
                "tokens_per_second_metered": m["tokens_per_second"], "realized_kl_mean": m["realized_kl_mean"],
                "realized_kl_p90": m["realized_kl_p90"], "realized_tv_mean": m["realized_tv_mean"],
                "mean_verifier_loglik": ll,
                "loglik_vs_sps": (ll - ref_loglik) if ll is not None and ref_loglik is not None else None}


@dataclass
class Calibration:
    rule: str
    k0: int
    deltas: list[dict[str, Any]] = field(default_factory=list)
    ks: list[dict[str, Any]] = field(default_factory=list)
    chosen_delta: float | None = None
    chosen_k: int | None = None
    cost_ratio: float | None = None
    meter_overhead: float | None = None
    reason: str = ""


def choose_delta(rows: list[dict[str, Any]], max_divergence: float, max_quality_drop: float | None) -> tuple[float, str]:
    ok = []
    for r in rows:
        kl = r["realized_kl_mean"]
        if kl is None or kl > max_divergence:
            continue
        if max_quality_drop is not None and (r["loglik_vs_sps"] or 0.0) < -max_quality_drop:
            continue
        ok.append(r["delta"])
    if not ok:
        return 0.0, "no delta met the constraints; SpS (delta = 0) is the safe choice"
    best = max(ok)
    why = f"largest delta with mean realized KL <= {max_divergence:g}"
    if max_quality_drop is not None:
        why += f" and log-likelihood drop <= {max_quality_drop:g} nats/token"
    return best, why


def run(engine, settings: Settings, prompts, base, deltas: list[float], ks: list[int], max_divergence: float,
        max_quality_drop: float | None, on_prompt: Callable[[str], None]) -> Calibration:
    rule = settings.rule
    if rule not in ("cactus", "cactus-exact"):
        raise ConfigError(f"calibrate tunes delta: use --rule cactus or cactus-exact (got {rule!r})")
    if any(d < 0 for d in deltas):
        raise ConfigError("--delta: values must be >= 0")
    deltas = sorted(set([0.0] + list(deltas)))
    k0 = settings.num_draft_tokens
    cal = Calibration(rule=rule, k0=k0)
    extra = {k: v for k, v in settings.rule_kwargs().items() if k != "delta"}

    # 1. delta sweep at k0, meter on
    metered = type(base)(**{**base.__dict__, "measure": True})
    points: list[DeltaPoint] = []
    for d in deltas:
        cfg = BenchConfig("speculative", rule, k0, {**extra, "delta": d})
        sink: list[ConfigResult] = []
        run_speculative(engine, cfg, prompts, metered, lambda d=d: on_prompt(f"delta={d:g} k={k0}"), sink)
        points.append(DeltaPoint(d, sink[0]))
    ref = points[0].result.stats.mean_verifier_loglik
    cal.deltas = [pt.row(ref) for pt in points]

    # 2. delta from the constraints
    cal.chosen_delta, cal.reason = choose_delta(cal.deltas, max_divergence, max_quality_drop)
    chosen = next(pt for pt in points if pt.delta == cal.chosen_delta)
    a = chosen.result.stats.per_token_acceptance or 0.0  # the cost model's i.i.d. per-token rate

    # 3. k: cost model to prune, then measured tokens/s with the meter off
    timed = type(base)(**{**base.__dict__, "measure": False})
    sink0: list[ConfigResult] = []
    cfg0 = BenchConfig("speculative", rule, k0, {**extra, "delta": cal.chosen_delta})
    run_speculative(engine, cfg0, prompts, timed, lambda: on_prompt(f"timing k={k0}"), sink0)
    cal.cost_ratio = c = cost_ratio(sink0[0])
    metered_s = chosen.result.stats.total_seconds
    plain_s = sink0[0].stats.total_seconds
    cal.meter_overhead = metered_s / plain_s - 1 if plain_s > 0 else None
    ranked = sorted(ks, key=lambda k: -predicted_speedup(a, k, c))
    to_time = [k for k in ranked[:KEEP_K] if k != k0]
    measured = {k0: sink0[0]}
    for k in to_time:
        sink: list[ConfigResult] = []
        cfg = BenchConfig("speculative", rule, k, {**extra, "delta": cal.chosen_delta})
        run_speculative(engine, cfg, prompts, timed, lambda k=k: on_prompt(f"timing k={k}"), sink)
        measured[k] = sink[0]
    for k in sorted(set(ks) | {k0}):
        res = measured.get(k)
        cal.ks.append({"k": k, "predicted_speedup": predicted_speedup(a, k, c),
                       "tokens_per_second": res.stats.tokens_per_second if res else None,
                       "mean_accepted_tokens_per_step": res.stats.mean_accepted_tokens_per_step if res else None,
                       "timed": res is not None})
    cal.chosen_k = max(measured, key=lambda k: measured[k].stats.tokens_per_second or 0.0)
    return cal


def document(cal: Calibration, settings: Settings, prompts, max_divergence: float,
             max_quality_drop: float | None, env: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "rule": cal.rule,
        "chosen": {"delta": cal.chosen_delta, "num_draft_tokens": cal.chosen_k, "reason": cal.reason},
        "constraints": {"max_divergence": max_divergence, "max_quality_drop": max_quality_drop},
        "delta_sweep": {"k": cal.k0, "rows": cal.deltas},
        "k_sweep": {"delta": cal.chosen_delta, "cost_ratio": cal.cost_ratio, "rows": cal.ks},
        "meter_overhead": cal.meter_overhead,
        "prompts": [p.id for p in prompts],
        "environment": env,
        "settings": settings.to_dict(),
    }


# --------------------------------------------------------------------------- saving


def save_target(name_or_path: str) -> Path:
    """NAME -> the user profile folder; anything path-like -> that file. Never a built-in."""
    looks_like_path = name_or_path.endswith((".yaml", ".yml")) or "/" in name_or_path
    path = Path(name_or_path).expanduser() if looks_like_path else user_profile_dir() / f"{name_or_path}.yaml"
    if path.resolve().parent == builtin_profile_dir().resolve():
        raise ConfigError(f"--save: {path} is a built-in profile; save under another name (it goes to {user_profile_dir()})")
    if not looks_like_path and not name_or_path.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ConfigError(f"--save: {name_or_path!r} is not a usable profile name (letters, digits, - _ .)")
    return path


def save_profile(target: Path, base_profile: str | None, settings: Settings, doc: dict[str, Any]) -> Path:
    """Write the chosen delta and k and a calibration block, keeping every other key of the
    target (or, for a new file, of the profile the run used). Atomic: temp file + rename."""
    import yaml

    from cactus_cli.fileio import atomic_write

    data: dict[str, Any] = {}
    source = target if target.is_file() else find_profile(base_profile or "default") if (
        base_profile or any(n == "default" for n, _, _ in list_profiles())) else None
    if source is not None:
        loaded = yaml.safe_load(source.read_text(encoding="utf-8")) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"--save: {source} is not a profile mapping; not overwriting it")
        data.update(loaded)
    # what this calibration ran with: the pair and the sampling it is valid for
    for key in ("verifier", "draft", "tokenizer", "device", "dtype", "temperature", "top_k", "top_p", "rule_params"):
        value = getattr(settings, key)
        if value != data.get(key) and value not in (None, {}):
            data[key] = value
    data["rule"] = doc["rule"]
    data["delta"] = float(doc["chosen"]["delta"])
    data["num_draft_tokens"] = int(doc["chosen"]["num_draft_tokens"])
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
        "temperature": settings.temperature,
        "top_k": settings.top_k,
        "top_p": settings.top_p,
    }
    text = "# written by `cactus calibrate`; other keys kept as they were\n" + yaml.safe_dump(data, sort_keys=False)
    return atomic_write(target, text)
