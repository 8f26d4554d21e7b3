"""The docs' HumanEval tables, rebuilt from `cactus eval --out DIR` folders (their progress.jsonl),
finished or not: one row per configuration over the problems every folder has finished.

    python benchmarks/eval_tables.py /work/he/k10 /work/he/k10exact
    python benchmarks/eval_tables.py he/k10 --json
    python benchmarks/eval_tables.py /work/he/k10,/work/he/k10tail116 /work/he/k10exact   # a run in two parts

Each folder's first row must be the verifier alone; rows from several folders are put side by
side only if their verifier-alone answers agree problem by problem (the same seeds give the same
text), so every paired difference is against the same baseline. Per row: pass@1, its paired
difference from the verifier alone (95% percentile bootstrap over problems, as `cactus eval`),
problems won and lost, MAL, accepted draft tokens per drafting step and its ratio to the SpS row
at the same k (with a bootstrap interval over problems), output tokens per verifier call and its
ratio to SpS's (the same interval), the realized KL per token (mean, max)
and the largest per-draft budget KL(h^(n) || q) against the rule's bound.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

from cactus_cli.app.eval.checkpoint import FILE, records
from cactus_cli.core.acceptance import RULES, resolve_params
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.intervals import paired_difference, wilson
from cactus_cli.core.stats import SpecStats

RESAMPLES = 10_000


def read(folder: Path) -> tuple[dict[str, dict[str, dict]], dict[str, float | None]]:
    """problem -> label -> {"stats": SpecStats, "passed": [bool], "texts": [str]} (samples merged),
    and each row's budget bound."""
    try:
        head, done, _ = records(folder / FILE)  # (a last line cut short by a kill: left out)
    except ConfigError as e:
        sys.exit(str(e))
    out: dict[str, dict[str, dict]] = {}
    for problem, generated in done.items():
        per = out.setdefault(problem, {})
        for g in generated:
            cell = per.setdefault(g.label, {"stats": SpecStats(), "passed": [], "texts": []})
            cell["stats"].merge(g.stats)
            cell["passed"].append(bool(g.verdict and g.verdict[0]))
            cell["texts"].append(g.text)
    return out, budget_bounds(folder, head)


def budget_bounds(folder: Path, head: dict) -> dict[str, float | None]:
    """Each row's largest per-draft budget KL(h^(n) || q), from its rule and parameters (the rule's
    own ``budget_bound``: delta for exact-KL Cactus, log(1 + 2 delta) for the closed form). The
    progress file's first line names them; a run started before it did has them in its eval.json
    (written when the run ends or is stopped)."""
    rows = head.get("rows")
    if not rows and (folder / "eval.json").is_file():
        rows = {r["config"]: r for r in json.loads((folder / "eval.json").read_text(encoding="utf-8"))["results"]}
    if not rows:
        print(f"{folder}: no row names its rule yet (no eval.json): budget bounds left out", file=sys.stderr)
        return {}
    return {
        label: RULES[r["rule"]].budget_bound(resolve_params(r["rule"], r.get("rule_params")))
        if r.get("rule") in RULES
        else None
        for label, r in rows.items()
    }


def read_parts(parts: list[Path]) -> tuple[dict[str, dict[str, dict]], dict[str, float | None]]:
    """One run kept in several folders, each over other problems (a run split to use more cores:
    a task file of the later problems with ``--seed`` moved by as many, so each problem keeps its
    seed): their problems together, the first folder's where two hold one."""
    run: dict[str, dict[str, dict]] = {}
    bounds: dict[str, float | None] = {}
    for part in parts:
        more, each = read(part)
        for problem, cells in more.items():
            run.setdefault(problem, cells)
        bounds.update(each)
    return run, bounds


def merge(
    folders: list[list[Path]],
) -> tuple[list[str], list[str], dict[str, dict[str, dict]], dict[str, float | None]]:
    read_back = [read_parts(parts) for parts in folders]
    runs = [run for run, _ in read_back]
    bounds = {label: b for _, each in read_back for label, b in each.items()}
    problems = sorted(set.intersection(*(set(r) for r in runs)), key=_order)
    labels: list[str] = []
    merged: dict[str, dict[str, dict]] = {p: {} for p in problems}
    alone = None
    for folder, run in zip(folders, runs):
        first = next(iter(run[problems[0]])) if problems else None
        if alone is None:
            alone = first
        elif first != alone:
            sys.exit(f"{','.join(map(str, folder))}: its first row is {first!r}, not {alone!r}")
        for p in problems:
            if p in merged and alone in merged[p] and merged[p][alone]["texts"] != run[p][alone]["texts"]:
                sys.exit(
                    f"{','.join(map(str, folder))}: the verifier alone answered {p} otherwise than in "
                    f"{','.join(map(str, folders[0]))}: not one baseline"
                )
            for label, cell in run[p].items():
                merged[p].setdefault(label, cell)
                if label not in labels:
                    labels.append(label)
    return problems, labels, merged, bounds


def regrade(merged: dict[str, dict[str, dict]]) -> list[tuple[str, str, bool, bool]]:
    """Run every HumanEval completion's check again with the sandbox as it is now; the verdicts
    are replaced, and each one that changed is returned (problem, row, before, after)."""
    from cactus_cli.app.eval.sandbox import run_checks
    from cactus_cli.app.eval.tasks import humaneval_tasks

    tasks = {t.id: t for t in humaneval_tasks()}
    cells = [(p, lab, i) for p, per in merged.items() for lab, cell in per.items() for i in range(len(cell["texts"]))]
    outcomes = run_checks([tasks[p].program(merged[p][lab]["texts"][i]) for p, lab, i in cells])
    changed = []
    for (p, lab, i), o in zip(cells, outcomes):
        before = merged[p][lab]["passed"][i]
        if before != o.passed:
            changed.append((p, lab, before, o.passed))
        merged[p][lab]["passed"][i] = o.passed
    return changed


def _order(problem: str) -> tuple:
    head, _, n = problem.rpartition("/")
    return (head, int(n)) if n.isdigit() else (problem, 0)


def per_step(stats: dict[str, SpecStats], pick: list[str]) -> float:
    """Accepted draft tokens per drafting step over the problems ``pick``."""
    steps = sum(stats[k].num_drafts for k in pick)
    return sum(stats[k].num_accepted_tokens for k in pick) / steps if steps else math.nan


def per_call(stats: dict[str, SpecStats], pick: list[str]) -> float:
    """Output tokens per verifier forward pass (prefill included) over the problems ``pick``: what
    sets the speed, and with -k auto the fair comparison, since the policy also decides which steps
    draft at all (a rule accepting more drafts where SpS would not draft lowers its per-step mean)."""
    calls = sum(stats[k].verifier_forward_passes for k in pick)
    return sum(stats[k].num_output_tokens for k in pick) / calls if calls else math.nan


def ratio_interval(
    num: dict[str, SpecStats], den: dict[str, SpecStats], keys: list[str], measure=per_step
) -> tuple[float, float, float]:
    """``measure`` of one row over another's, and its 95% bootstrap interval over problems (each
    problem's counts resampled together)."""
    point = measure(num, keys) / measure(den, keys)
    rng = random.Random(0)
    n = len(keys)
    boots = []
    for _ in range(RESAMPLES):
        pick = [keys[rng.randrange(n)] for _ in range(n)]
        boots.append(measure(num, pick) / measure(den, pick))
    boots.sort()
    return point, boots[int(0.025 * RESAMPLES)], boots[int(0.975 * RESAMPLES) - 1]


def rows(
    problems: list[str], labels: list[str], merged: dict[str, dict[str, dict]], bounds: dict[str, float | None]
) -> list[dict]:
    alone = labels[0]
    rates = {
        lab: {p: sum(merged[p][lab]["passed"]) / len(merged[p][lab]["passed"]) for p in problems} for lab in labels
    }
    stats = {lab: {p: merged[p][lab]["stats"] for p in problems} for lab in labels}
    out = []
    for lab in labels:
        total = SpecStats()
        for p in problems:
            total.merge(stats[lab][p])
        graded = sum(len(merged[p][lab]["passed"]) for p in problems)
        correct = sum(sum(merged[p][lab]["passed"]) for p in problems)
        lo, hi = wilson(correct, graded)
        row = {
            "config": lab,
            "problems": len(problems),
            "samples": graded // max(len(problems), 1),
            "pass_at_1": correct / graded if graded else math.nan,
            "pass_ci95": [lo, hi],
            "mal": total.mean_acceptance_length,
            "accepted_per_step": total.mean_accepted_tokens_per_step,
            "tokens_per_verifier_call": per_call(stats[lab], problems),
            "per_token_acceptance": total.per_token_acceptance,
            "mean_k": total.mean_k,
            "tokens_per_answer": total.num_output_tokens / graded if graded else math.nan,
            "realized_kl_mean": sum(total.realized_kl) / len(total.realized_kl) if total.realized_kl else None,
            "realized_kl_max": max(total.realized_kl) if total.realized_kl else None,
            "budget_max": max(total.draft_budget) if total.draft_budget else None,
            "budget_bound": bounds.get(lab),
        }
        if lab != alone:
            d, dlo, dhi, _ = paired_difference(rates[lab], rates[alone])
            row["vs_alone"] = [d, dlo, dhi]
            row["won"] = sum(rates[lab][p] > rates[alone][p] for p in problems)
            row["lost"] = sum(rates[lab][p] < rates[alone][p] for p in problems)
            k = lab.rsplit(" k=", 1)[-1] if " k=" in lab else None
            sps = next((x for x in labels if x == f"sps k={k}"), None)
            if sps and sps != lab and total.num_drafts:
                row["accepted_vs_sps"] = list(ratio_interval(stats[lab], stats[sps], problems))
                row["tokens_per_call_vs_sps"] = list(ratio_interval(stats[lab], stats[sps], problems, per_call))
        out.append(row)
    return out


def markdown(table: list[dict]) -> str:
    def f(x, spec="{:.2f}"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else spec.format(x)

    head = (
        "| row | pass@1 % [95% CI] | vs verifier alone, paired [95% CI] | won / lost | MAL | accepted / step "
        "| vs SpS's, per step [95% CI] | tokens / verifier call, vs SpS's [95% CI] "
        "| realized KL / token: mean, max | budget max (bound) |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in table:
        ci, vs, ratio, calls = (
            r["pass_ci95"],
            r.get("vs_alone"),
            r.get("accepted_vs_sps"),
            r.get("tokens_per_call_vs_sps"),
        )
        kl = "-" if r["realized_kl_mean"] is None else f"{r['realized_kl_mean']:.4f}, {r['realized_kl_max']:.3f}"
        budget = "-" if r["budget_max"] is None else f"{r['budget_max']:.3f} ({f(r['budget_bound'], '{:.3f}')})"
        cells = [
            r["config"],
            f"{100 * ci[0]:.1f}, {100 * ci[1]:.1f}",
            "-" if vs is None else f"{100 * vs[0]:+.1f} [{100 * vs[1]:+.1f}, {100 * vs[2]:+.1f}]",
            "-" if vs is None else f"{r['won']} / {r['lost']}",
            f(r["mal"]),
            f(r["accepted_per_step"]),
            "-" if ratio is None else f"{ratio[0]:.3f}x [{ratio[1]:.3f}, {ratio[2]:.3f}]",
            f(r["tokens_per_verifier_call"])
            + ("" if calls is None else f", {calls[0]:.3f}x [{calls[1]:.3f}, {calls[2]:.3f}]"),
            kl,
            budget,
        ]
        cells[1] = f"{100 * r['pass_at_1']:.1f} [{cells[1]}]"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "folders",
        nargs="+",
        help="cactus eval --out folders (the first one's verifier alone is the baseline); A,B: one run "
        "kept in two folders over other problems",
    )
    ap.add_argument("--json", action="store_true", help="one JSON document instead of the markdown table")
    ap.add_argument(
        "--regrade",
        action="store_true",
        help="run every HumanEval check again (isolated) and say which verdicts change",
    )
    args = ap.parse_args()
    groups = [[Path(part) for part in arg.split(",")] for arg in args.folders]
    for folder in (part for parts in groups for part in parts):
        if not (folder / FILE).is_file():
            sys.exit(f"{folder}: no {FILE} (give a cactus eval --out folder)")
    problems, labels, merged, bounds = merge(groups)
    if not problems:
        sys.exit("no problem is finished in every folder")
    changed = regrade(merged) if args.regrade else []
    if args.regrade:
        print(f"regraded: {len(changed)} verdicts changed {changed}", file=sys.stderr)
    table = rows(problems, labels, merged, bounds)
    if args.json:
        print(json.dumps({"problems": len(problems), "rows": table}, indent=2))
    else:
        print(f"{len(problems)} problems finished in every folder\n")
        print(markdown(table))


if __name__ == "__main__":
    main()
