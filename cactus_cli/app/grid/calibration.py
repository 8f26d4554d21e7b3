"""Choosing delta and k from measurements (no Rich here).

1. Sweep delta at one k with the divergence meter on: per-token acceptance `a`, accepted tokens
   per step, the realized KL(h_alg || q) per position, and the verifier log-likelihood of the
   generated tokens relative to SpS (delta = 0 is always in the sweep).
2. Choose the largest delta whose mean realized KL is within --max-divergence (and whose
   log-likelihood drop is within --max-quality-drop, when given; with --tasks, whose accuracy
   against delta = 0, paired over the same problems, drops by at most --max-accuracy-drop points
   with a 95% interval that reaches zero; with --min-acceptance-gain, that accepts at least that
   many times delta = 0's draft tokens per step). None: SpS (delta = 0 is SpS).
3. Rank the candidate k with the engine's own cost model (costs.py: draft seconds per token and
   verifier seconds per width t_v(w), measured on this machine) and the chosen delta's `a`; time the
   verifier alone, the best few k and `-k auto` with the meter off, and keep the fastest. When
   plain decoding wins, say so: this draft does not pay on this machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from cactus_cli.app.config.settings import Settings, check_each
from cactus_cli.app.grid.configs import BenchConfig
from cactus_cli.app.grid.sweep import ConfigResult, Grade, run_speculative
from cactus_cli.core.acceptance import RULES
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.intervals import paired_difference
from cactus_cli.infer.kpolicy.costs import CostModel, tokens_per_second

DEFAULT_DELTAS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)
DEFAULT_KS = tuple(range(1, 13))
# Mean realized KL(h_alg || q) per emitted position, in nats. See README "Calibrate": 0.05 nats
# keeps the emitted distribution within TV <= sqrt(0.05 / 2) ~ 0.16 of the verifier (Pinsker),
# per token, and sits below what the paper's delta = 1 realizes on the embedded pair.
DEFAULT_MAX_DIVERGENCE = 0.05
KEEP_K = 3  # how many k the cost model lets through to be timed
SWEEP_K = 4  # the delta sweep's k when the profile's k is auto


def measured_speedup(costs: CostModel, a: float, k: int) -> float:
    """Expected tokens per second at k over plain decoding's 1 / t_v(1), with the verifier's cost
    measured per width (Leviathan et al.'s (1 - a^(k+1)) / ((1 - a)(1 + k c)) assumes t_v(k+1) =
    t_v(1), which is false by 4-8x on an AVX2 CPU)."""
    return tokens_per_second(costs, a, k) * costs.t_v(1)


@dataclass
class DeltaPoint:
    delta: float
    result: ConfigResult

    def row(self, ref_loglik: float | None, ref: ConfigResult | None = None) -> dict[str, Any]:
        m = self.result.metrics()
        ll = m["mean_verifier_loglik"]
        al, ref_al = m["mean_accepted_tokens_per_step"], ref.stats.mean_accepted_tokens_per_step if ref else None
        graded = {}
        if self.result.graded:  # --tasks: accuracy, and its change from delta = 0 over the same problems
            d, lo, hi, n = paired_difference(self.result.pass_rates(), ref.pass_rates())
            graded = {
                "accuracy": self.result.correct / self.result.graded,
                "accuracy_vs_sps": d,
                "accuracy_vs_sps_ci95": [lo, hi],
                "problems": n,
            }
        return {
            **graded,
            "delta": self.delta,
            "acceptance_rate": m["draft_acceptance_rate"],
            "per_token_acceptance": m["per_token_acceptance"],
            "mean_accepted_tokens_per_step": al,
            "accepted_vs_sps": al / ref_al if al is not None and ref_al else None,  # (per step, vs delta = 0)
            "tokens_per_second_metered": m["tokens_per_second"],
            "realized_kl_mean": m["realized_kl_mean"],
            "realized_kl_p90": m["realized_kl_p90"],
            "realized_tv_mean": m["realized_tv_mean"],
            "mean_verifier_loglik": ll,
            "loglik_vs_sps": (ll - ref_loglik) if ll is not None and ref_loglik is not None else None,
        }


@dataclass
class Calibration:
    rule: str
    k0: int
    deltas: list[dict[str, Any]] = field(default_factory=list)
    ks: list[dict[str, Any]] = field(default_factory=list)
    chosen_delta: float | None = None
    chosen_k: int | str | None = None
    cost_ratio: float | None = None  # draft seconds per token over a 1-token verify
    verify_cost_by_width: dict[str, float] = field(default_factory=dict)  # relative to a 1-token verify
    plain_tokens_per_second: float | None = None
    meter_overhead: float | None = None
    reason: str = ""
    advice: str = ""  # said plainly when speculation with this draft does not pay here
    interrupted: str = ""  # Ctrl-C or SIGTERM came: where (the rows that finished are kept)


@dataclass(frozen=True)
class Constraints:
    """What a chosen delta must meet (the command line's --max-* and --min-* options)."""

    max_divergence: float = DEFAULT_MAX_DIVERGENCE  # mean realized KL(h_alg || q) per token, nats
    max_quality_drop: float | None = None  # mean verifier log-likelihood per token vs delta = 0, nats
    max_accuracy_drop: float | None = None  # points of accuracy vs delta = 0, paired (--tasks)
    min_acceptance_gain: float | None = None  # accepted draft tokens per step over delta = 0's

    def describe(self) -> str:
        said = [f"mean realized KL <= {self.max_divergence:g}"]
        if self.max_quality_drop is not None:
            said.append(f"log-likelihood drop <= {self.max_quality_drop:g} nats/token")
        if self.max_accuracy_drop is not None:
            said.append(
                f"accuracy drop <= {self.max_accuracy_drop:g} points with its 95% interval reaching 0 (paired, vs delta = 0)"
            )
        if self.min_acceptance_gain is not None:
            said.append(f"accepted tokens per step >= {self.min_acceptance_gain:g}x delta = 0's")
        return " and ".join(said)

    def allow(self, r: dict[str, Any]) -> bool:
        """Whether one row of the delta sweep meets them (delta = 0, SpS, is the reference of the last two)."""
        kl = r["realized_kl_mean"]
        if kl is None or kl > self.max_divergence:
            return False
        if self.max_quality_drop is not None and (r["loglik_vs_sps"] or 0.0) < -self.max_quality_drop:
            return False
        if r["delta"] == 0:
            return True
        if self.max_accuracy_drop is not None:
            # the point estimate within the allowance, and no drop the data already confirms
            d, (_, hi) = r.get("accuracy_vs_sps", 0.0), r.get("accuracy_vs_sps_ci95", (0.0, 0.0))
            if 100 * d < -self.max_accuracy_drop or hi < 0:
                return False
        return self.min_acceptance_gain is None or (r.get("accepted_vs_sps") or 0.0) >= self.min_acceptance_gain

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def choose_delta(rows: list[dict[str, Any]], constraints: Constraints) -> tuple[float, str]:
    """The largest delta within every constraint, or SpS (delta = 0) when no larger one is."""
    best = max((r["delta"] for r in rows if constraints.allow(r)), default=0.0)
    if best == 0.0:
        return 0.0, f"no delta above 0 met {constraints.describe()}; SpS (delta = 0) is the safe choice"
    return best, f"largest delta with {constraints.describe()}"


def validate(settings: Settings, deltas: list[float], ks: list[int]) -> None:
    """Everything a calibration checks, before any model loads."""

    if "delta" not in RULES[settings.rule].param_names():
        takes = " or ".join(name for name, rule in RULES.items() if "delta" in rule.param_names())
        raise ConfigError(f"calibrate tunes delta: use --rule {takes} (got {settings.rule!r})")
    check_each("delta", deltas, "--delta")
    check_each("max_draft_tokens", ks, "-k")  # fixed k only: the same 1..64 range


def sweep_k(settings: Settings, ks: list[int]) -> int:
    """The k of the delta sweep: the candidate nearest the profile's k (SWEEP_K for -k auto)."""
    want = SWEEP_K if settings.num_draft_tokens == "auto" else int(settings.num_draft_tokens)
    return min(ks, key=lambda k: (abs(k - want), k))


def run(
    engine,
    settings: Settings,
    prompts,
    base,
    deltas: list[float],
    ks: list[int],
    constraints: Constraints,
    on_prompt: Callable[[str], None],
    grade: Grade | None = None,
) -> Calibration:
    """``grade``: the prompts are tasks (--tasks), each delta's answers graded."""
    validate(settings, deltas, ks)
    k0 = sweep_k(settings, ks)
    cal = Calibration(rule=settings.rule, k0=k0)
    extra = {k: v for k, v in settings.rule_kwargs().items() if k != "delta"}

    # 1. delta sweep at k0, meter on; 2. delta from the constraints
    points: list[DeltaPoint] = []
    try:
        _sweep_deltas(
            engine,
            settings.rule,
            k0,
            extra,
            prompts,
            replace(base, measure=True),
            sorted(set([0.0] + list(deltas))),
            on_prompt,
            grade,
            points,
        )
    except KeyboardInterrupt:
        if not points:
            raise
        cal.interrupted = "during the delta sweep"
    cal.deltas = [pt.row(points[0].result.stats.mean_verifier_loglik, points[0].result) for pt in points]
    if cal.interrupted:
        return cal
    cal.chosen_delta, cal.reason = choose_delta(cal.deltas, constraints)
    chosen = next(pt for pt in points if pt.delta == cal.chosen_delta)

    # 3. k: the measured cost model ranks, then tokens/s with the meter off decides
    timed = replace(base, measure=False)

    def time_config(cfg: BenchConfig, label: str) -> ConfigResult:
        sink: list[ConfigResult] = []
        run_speculative(engine, cfg, prompts, timed, lambda: on_prompt(label), sink)
        return sink[0]

    try:
        _choose_k(
            cal,
            engine.costs.costs,
            chosen,
            ks,
            {**extra, "delta": cal.chosen_delta},
            settings.max_draft_tokens,
            time_config,
        )
    except KeyboardInterrupt:
        cal.interrupted, cal.ks = "while timing k", []
    return cal


def _sweep_deltas(
    engine,
    rule: str,
    k0: int,
    extra: dict[str, Any],
    prompts,
    metered,
    deltas: list[float],
    on_prompt: Callable[[str], None],
    grade: Grade | None = None,
    points: list[DeltaPoint] | None = None,
) -> list[DeltaPoint]:
    """Each delta's metered run at k0, appended to ``points`` as it finishes (an interrupted sweep
    keeps the finished ones)."""
    points = [] if points is None else points
    for d in deltas:
        cfg = BenchConfig("speculative", rule, k0, {**extra, "delta": d})
        sink: list[ConfigResult] = []
        run_speculative(engine, cfg, prompts, metered, lambda d=d: on_prompt(f"delta={d:g} k={k0}"), sink, grade)
        points.append(DeltaPoint(d, sink[0]))
    return points


def _choose_k(
    cal: Calibration,
    costs: CostModel,
    chosen: DeltaPoint,
    ks: list[int],
    kd: dict[str, Any],
    k_max: int,
    time_config: Callable[[BenchConfig, str], ConfigResult],
) -> None:
    """Time the verifier alone, the k the cost model (the probe plus every step so far) ranks
    best, k0 and -k auto; keep the fastest, or auto when plain decoding wins."""
    rule, k0 = cal.rule, cal.k0
    a = chosen.result.stats.per_token_acceptance or 0.0  # the cost model's i.i.d. per-token rate
    plain = time_config(BenchConfig("speculative", "sps", 0), "timing verifier alone")  # k = 0: no drafts
    cal.plain_tokens_per_second = plain.stats.tokens_per_second
    t1 = costs.t_v(1)
    cal.cost_ratio = costs.t_d() / t1 if t1 else None
    cal.verify_cost_by_width = {str(w): costs.t_v(w) / t1 for w in range(1, max(ks) + 2)} if t1 else {}
    ranked = sorted(ks, key=lambda k: -measured_speedup(costs, a, k))
    measured: dict[int | str, ConfigResult] = {}
    for k in dict.fromkeys([k0] + ranked[:KEEP_K]):  # k0 too: its metered twin gives the meter's cost
        measured[k] = time_config(BenchConfig("speculative", rule, k, kd), f"timing k={k}")
    auto = measured["auto"] = time_config(BenchConfig("speculative", rule, k_max, kd, adaptive=True), "timing k=auto")
    sweep_s = measured[k0].stats.total_seconds  # the metered sweep's twin, meter off
    cal.meter_overhead = chosen.result.stats.total_seconds / sweep_s - 1 if sweep_s else None
    for k in sorted(ks):
        res = measured.get(k)
        cal.ks.append(
            {
                "k": k,
                "predicted_speedup": measured_speedup(costs, a, k),
                "tokens_per_second": res.stats.tokens_per_second if res else None,
                "mean_accepted_tokens_per_step": res.stats.mean_accepted_tokens_per_step if res else None,
                "timed": res is not None,
            }
        )
    cal.ks.append(
        {
            "k": "auto",
            "predicted_speedup": None,
            "tokens_per_second": auto.stats.tokens_per_second,
            "mean_accepted_tokens_per_step": auto.stats.mean_accepted_tokens_per_step,
            "timed": True,
            "mean_k": auto.stats.mean_k,
        }
    )
    # the choice and the advice come from the rows the table prints (measured tok/s), never from
    # the cost model's prediction alone: the two must not contradict each other
    cal.chosen_k = max(measured, key=lambda k: measured[k].stats.tokens_per_second or 0.0)
    best = measured[cal.chosen_k].stats.tokens_per_second or 0.0
    plain_tps = cal.plain_tokens_per_second or 0.0
    if plain_tps >= best:
        fastest = f"k = {cal.chosen_k}"
        cal.chosen_k = "auto"  # drafts only when it pays: on this machine, mostly plain decoding
        cal.advice = (
            f"speculation with this draft does not pay on this machine: the verifier alone ran "
            f"{plain_tps:.2f} tok/s, the best speculative setting ({fastest}) {best:.2f} tok/s "
            f"(a draft token costs {cal.cost_ratio or 0:.2f} of a 1-token verify, a {max(ks) + 1}-token "
            f"verify {cal.verify_cost_by_width.get(str(max(ks) + 1), 0):.2f}x one); k = auto is chosen, "
            "which falls back to plain decoding (k = 0) and drafts again when it pays. --draft none "
            "runs the verifier alone; a cheaper draft, or a faster dtype (--dtype), may change this."
        )


def document(
    cal: Calibration,
    settings: Settings,
    prompts,
    constraints: Constraints,
    env: dict[str, Any],
) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "rule": cal.rule,
        "chosen": {
            "delta": cal.chosen_delta,
            "num_draft_tokens": cal.chosen_k,
            "reason": cal.reason,
            "advice": cal.advice,
        },
        "constraints": constraints.to_dict(),
        "delta_sweep": {"k": cal.k0, "rows": cal.deltas},
        "k_sweep": {
            "delta": cal.chosen_delta,
            "cost_ratio": cal.cost_ratio,
            "verify_cost_by_width": cal.verify_cost_by_width,
            "verifier_alone_tokens_per_second": cal.plain_tokens_per_second,
            "rows": cal.ks,
        },
        "meter_overhead": cal.meter_overhead,
        "prompts": [p.id for p in prompts],
        "environment": env,
        "settings": settings.to_dict(),
    }
