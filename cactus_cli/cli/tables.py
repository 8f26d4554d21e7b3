"""Rich for results: the bench and eval tables, the calibration report and chart, the
quantization quality table."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from cactus_cli.cli.ui import STYLES, cost_line

_BENCH_COLUMNS = [  # (key, header, format, better); MAL = 1 + AL is in the JSON
    ("mean_accepted_tokens_per_step", "AL", "{:.2f}", max),
    ("per_token_acceptance", "a", "{:.3f}", max),
    ("draft_acceptance_rate", "accept", "{:.1%}", max),
    ("tokens_per_second", "tok/s", "{:.2f}", max),
    ("ms_per_output_token", "ms/tok", "{:.0f}", min),
    ("speedup", "speedup", "{:.2f}x", max),
    ("tokens_per_second_vs_hf", "vs HF", "{:.2f}x", max),
    ("verifier_forward_passes_per_token", "V/tok", "{:.2f}", min),
    ("mean_k", "k̄", "{:.2f}", None),
    ("realized_kl_mean", "KL", "{:.4f}", min),
    ("realized_tv_mean", "TV", "{:.4f}", min),
]
_TOGETHER_COLUMNS = [  # shown when a row ran requests together (bench --concurrency)
    ("concurrency", "at once", "{}", None),
    ("aggregate_tokens_per_second", "all tok/s", "{:.2f}", max),
    ("aggregate_speedup", "all speedup", "{:.2f}x", max),
    ("request_decode_tokens_per_second", "req tok/s", "{:.2f}", max),
    ("ttft_p50", "TTFT p50", "{:.2f}s", min),
    ("ttft_p90", "TTFT p90", "{:.2f}s", min),
]


def _bench_columns(rows: list[dict]) -> list[tuple]:
    """The columns some row has a value for; the together columns when a row ran requests at once."""
    cols = [c for c in _BENCH_COLUMNS if any(r.get(c[0]) is not None for r in rows)]
    if any((r.get("concurrency") or 1) > 1 for r in rows):
        cols += _TOGETHER_COLUMNS
    return cols


def _results_table(console: Console, doc: dict, counted: str, caption: str):
    """A grid's results table (bench, eval): titled with the pair, the device, ``counted`` (what
    ran: "8 prompts") and the temperature, its first column the configuration."""
    from rich.table import Table

    if not console.is_terminal:  # a file or pipe has no width: do not squeeze the numbers
        console.width = max(console.width, 132)
    env = doc["environment"]
    table = Table(
        title=f"{env['verifier']} / {env['draft']} · {env['device']} {env['dtype']} · {counted} · "
        f"T={doc['settings']['temperature']}",
        title_justify="left",
        caption_justify="left",
        padding=(0, 1),
        caption=caption,
    )
    table.add_column("config", overflow="fold", min_width=12)
    return table


def print_bench(console: Console, doc: dict) -> None:
    """The results table, best value per column in bold green; then speedup by category."""
    from rich.table import Table

    rows = doc["results"]
    cols = _bench_columns(rows)
    table = _results_table(
        console,
        doc,
        f"{len(doc['prompts'])} prompts",
        "AL: accepted draft tokens per step (MAL = 1 + AL); a: per-token acceptance; "
        "accept: accepted / drafted; speedup over the verifier alone; V/tok: verifier passes per token; "
        "k̄: mean draft length per step (k = auto picks it per step); at once: requests stepped together, "
        "all tok/s: every answer's tokens over the wall time from their submission to the last answer",
    )
    for _, header, _, _ in cols:
        table.add_column(header, justify="right", no_wrap=True)
    best = {}
    for key, _, _, better in cols:
        values = [r[key] for r in rows if r.get(key) is not None and r["kind"] != "autoregressive"]
        if values and better is not None:
            best[key] = better(values)
    for r in rows:
        cells = []
        for key, _, fmt, _ in cols:
            v = r.get(key)
            text = "-" if v is None else fmt.format(v)
            cells.append(Text(text, style="bold green" if v is not None and v == best.get(key) else ""))
        table.add_row(r["config"], *cells)
    console.print(table)
    for r in rows:
        if r["k"] == "auto" and r.get("k_histogram"):
            hist = r["k_histogram"]
            total = sum(hist) or 1
            shares = "  ".join(f"k={k} {100 * n / total:.0f}%" for k, n in enumerate(hist) if n)
            console.print(Text(f"{r['config']}: steps by chosen k: {shares}", style=STYLES["dim"]))
    if doc.get("cost_model"):
        console.print(Text(cost_line(doc["cost_model"]), style=STYLES["dim"]))
    cats = sorted({c for r in rows for c in r["by_category"]})
    if len(cats) > 1:
        t2 = Table(title="speedup (and AL) by category", title_justify="left")
        t2.add_column("config", no_wrap=True)
        for c in cats:
            t2.add_column(c, justify="right")
        for r in rows:
            if r["kind"] == "autoregressive":
                continue
            cells = []
            for c in cats:
                m = r["by_category"].get(c, {})
                sp, al = m.get("speedup"), m.get("mean_accepted_tokens_per_step")
                cells.append("-" if sp is None else f"{sp:.2f}x" + (f" ({al:.2f})" if al is not None else ""))
            t2.add_row(r["config"], *cells)
        console.print(t2)


def print_eval(console: Console, doc: dict) -> None:
    """Accuracy (95% Wilson interval) beside speed, one row per configuration; a note when the
    intervals of the verifier alone and a configuration overlap."""
    rows = doc["results"]
    total = len(doc["prompts"])
    done = max((r.get("problems") or 0 for r in rows), default=0)  # fewer when stopped early
    table = _results_table(
        console,
        doc,
        f"{f'{done} of {total}' if done < total else total} problems",
        "accuracy (pass@1 for code tasks) with its 95% Wilson interval; vs alone: the difference "
        "from the verifier alone over the same problems, with its 95% paired bootstrap interval; MAL: mean "
        "acceptance length (1 + accepted drafts per step); a: per-token acceptance; speedup over the verifier alone; "
        "with --meter, KL: the realized KL(h_alg || q) per token, its mean and largest; budget max: the largest "
        "KL(h^(n) || q) of a draft's own target (at most delta for exact-KL Cactus)",
    )
    metered = any(r.get("realized_kl_mean") is not None for r in rows)
    for header in ("accuracy", "95% interval", "vs alone (95%)", "n", "MAL", "a", "tok/s", "speedup") + (
        ("KL", "KL max", "budget max") if metered else ()
    ):
        table.add_column(header, justify="right", no_wrap=True)
    for r in rows:
        if r.get("problems") is None:
            continue
        al = r.get("mean_acceptance_length")
        paired = (
            "-"
            if r.get("paired_vs_alone") is None
            else f"{100 * r['paired_vs_alone']:+.1f} ({100 * r['paired_ci95_low']:+.1f}, {100 * r['paired_ci95_high']:+.1f})"
        )
        n = str(r["problems"]) + (f"x{r['samples']}" if r.get("samples", 1) > 1 else "")
        cells = [
            f"{100 * r['accuracy']:.1f}%",
            f"{100 * r['accuracy_ci95_low']:.1f}–{100 * r['accuracy_ci95_high']:.1f}%",
            paired,
            n,
            "-" if r["kind"] == "autoregressive" or al is None else f"{al:.2f}",
            "-" if r.get("per_token_acceptance") is None else f"{r['per_token_acceptance']:.3f}",
            "-" if r.get("tokens_per_second") is None else f"{r['tokens_per_second']:.2f}",
            "-" if r.get("speedup") is None else f"{r['speedup']:.2f}x",
        ]
        if metered:
            for key, fmt in (
                ("realized_kl_mean", "{:.4f}"),
                ("realized_kl_max", "{:.3f}"),
                ("draft_budget_kl_max", "{:.3f}"),
            ):
                cells.append("-" if r.get(key) is None else fmt.format(r[key]))
        table.add_row(r["config"], *cells)
    console.print(table)
    base = next((r for r in rows if r["kind"] == "autoregressive" and r.get("problems")), None)
    if base is not None:
        inside = [
            r["config"]
            for r in rows
            if r is not base
            and r.get("problems")
            and r["accuracy_ci95_low"] <= base["accuracy_ci95_high"]
            and base["accuracy_ci95_low"] <= r["accuracy_ci95_high"]
        ]
        if inside:
            console.print(
                Text(
                    f"inside the verifier's interval (no difference shown at this n): {', '.join(inside)}",
                    style=STYLES["dim"],
                )
            )


def print_calibration(console: Console, doc: dict) -> None:
    """The delta sweep, a terminal trade-off chart, the k sweep and the choice."""
    from rich.table import Table

    if not console.is_terminal:  # (a file or a pipe: whole numbers, not a column cut to 80)
        console.width = max(console.width, 132)
    rows = doc["delta_sweep"]["rows"]
    chosen = doc["chosen"]
    graded = any("accuracy" in r for r in rows)  # --tasks
    t = Table(title=f"delta sweep ({doc['rule']}, k={doc['delta_sweep']['k']}, meter on)", title_justify="left")
    for col in ("delta", "a", "AL", "AL vs SpS", "KL(h‖q) mean", "KL p90", "TV mean", "loglik vs SpS") + (
        ("accuracy", "vs SpS (95%)") if graded else ()
    ):
        t.add_column(col, justify="right", no_wrap=True)

    def f(v, fmt):
        return "-" if v is None else fmt.format(v)

    for r in rows:
        cells = [
            f"{r['delta']:g}",
            f(r["per_token_acceptance"], "{:.3f}"),
            f(r["mean_accepted_tokens_per_step"], "{:.2f}"),
            f(r.get("accepted_vs_sps"), "{:.3f}x"),
            f(r["realized_kl_mean"], "{:.4f}"),
            f(r["realized_kl_p90"], "{:.4f}"),
            f(r["realized_tv_mean"], "{:.4f}"),
            f(r["loglik_vs_sps"], "{:+.4f}"),
        ]
        if graded:
            lo, hi = r.get("accuracy_vs_sps_ci95", (None, None))
            cells.append(f(r.get("accuracy"), "{:.1%}"))
            cells.append(
                "-"
                if r["delta"] == 0 or lo is None
                else f"{100 * r['accuracy_vs_sps']:+.1f} ({100 * lo:+.1f}, {100 * hi:+.1f})"
            )
        t.add_row(*cells, style="bold green" if r["delta"] == chosen["delta"] else "")
    console.print(t)
    console.print(trade_off_chart(rows, doc["constraints"]["max_divergence"], max(10, (console.width - 34) // 2)))
    k = doc["k_sweep"]
    widths = k.get("verify_cost_by_width") or {}
    shape = ", ".join(f"t_v({w}) {widths[w]:.2f}" for w in sorted(widths, key=int)[1::2][:5])
    c = k.get("cost_ratio")
    t2 = Table(
        title=f"k sweep (delta={k['delta']:g}; costs relative to a 1-token verify: draft token "
        f"{'-' if c is None else f'{c:.2f}'}, {shape})",
        title_justify="left",
    )
    for col in ("k", "predicted speedup", "measured tok/s", "AL"):
        t2.add_column(col, justify="right")
    if k.get("verifier_alone_tokens_per_second") is not None:
        t2.add_row("0 (verifier alone)", "1.00x", f"{k['verifier_alone_tokens_per_second']:.2f}", "-")
    for r in k["rows"]:
        style = "bold green" if r["k"] == chosen["num_draft_tokens"] else ("" if r["timed"] else "dim")
        t2.add_row(
            str(r["k"]) + (f" (mean k {r['mean_k']:.2f})" if r.get("mean_k") is not None else ""),
            "-" if r["predicted_speedup"] is None else f"{r['predicted_speedup']:.2f}x",
            "-" if r["tokens_per_second"] is None else f"{r['tokens_per_second']:.2f}",
            "-" if r["mean_accepted_tokens_per_step"] is None else f"{r['mean_accepted_tokens_per_step']:.2f}",
            style=style,
        )
    console.print(t2)
    overhead = doc.get("meter_overhead")
    picked = "SpS (delta = 0)" if chosen["delta"] == 0 else f"delta = {chosen['delta']:g}"
    console.print(Text(f"chosen: {picked}, k = {chosen['num_draft_tokens']} ({chosen['reason']})", style="bold"))
    if chosen.get("advice"):
        console.print(Text(chosen["advice"], style="yellow"))
    if overhead is not None:
        console.print(Text(f"meter overhead: {overhead:+.1%} of generation time", style="dim"))


def trade_off_chart(rows: list[dict], budget: float, width: int = 36) -> Text:
    """Bars per delta: accepted tokens per step, and realized KL against the budget (|)."""
    al_max = max((r["mean_accepted_tokens_per_step"] or 0 for r in rows), default=1) or 1
    kl_max = max([r["realized_kl_mean"] or 0 for r in rows] + [budget]) or 1
    out = Text("trade-off: accepted tokens per step (█) and realized KL (▒, budget |)\n", style="dim")
    for r in rows:
        al = r["mean_accepted_tokens_per_step"] or 0
        kl = r["realized_kl_mean"] or 0
        out.append(f"delta {r['delta']:>5g}  ")
        out.append("█" * round(width * al / al_max), style="green")
        out.append(f" {al:.2f}".ljust(8))
        bar = ["▒" if i < round(width * kl / kl_max) else " " for i in range(width)]
        mark = min(width - 1, round(width * budget / kl_max))
        bar[mark] = "|"
        out.append("".join(bar), style="yellow")
        out.append(f" {kl:.4f}\n")
    return out


def plot_calibration_png(doc: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["delta_sweep"]["rows"]
    d = [r["delta"] for r in rows]
    fig, ax1 = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax1.plot(
        d, [r["mean_accepted_tokens_per_step"] for r in rows], "o-", color="tab:green", label="accepted tokens per step"
    )
    ax1.set_xlabel("delta (per-token budget)")
    ax1.set_ylabel("accepted draft tokens per step", color="tab:green")
    ax2 = ax1.twinx()
    ax2.plot(d, [r["realized_kl_mean"] for r in rows], "s--", color="tab:orange", label="realized KL(h_alg || q)")
    ax2.axhline(doc["constraints"]["max_divergence"], color="tab:red", lw=1, ls=":", label="divergence budget")
    ax2.set_ylabel("mean realized KL per token (nats)", color="tab:orange")
    ax1.axvline(doc["chosen"]["delta"], color="gray", lw=1)
    fig.suptitle(
        f"{doc['rule']} on {doc['environment']['verifier']} / {doc['environment']['draft']}, "
        f"k={doc['delta_sweep']['k']}",
        fontsize=9,
    )
    lines = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax1.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax1.legend(lines, labels, loc="lower right", fontsize=8)
    _save_figure(plt, fig, path)


def _save_figure(plt, fig, path) -> None:
    """``fig`` to the PNG ``path``, whole or not at all (written beside it, then moved in place)."""
    from pathlib import Path

    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def plot_tradeoff_png(doc: dict, path) -> None:
    """bench --plot: speed and mean acceptance length against the realized divergence (the
    meter), one point per configuration, SpS at zero divergence, the verifier alone as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from cactus_cli.core.acceptance import RULES

    rows = [r for r in doc["results"] if r["kind"] == "speculative" and r.get("realized_kl_mean") is not None]
    alone = next((r for r in doc["results"] if r["kind"] == "autoregressive"), None)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.8), dpi=120)
    for ax, key, label in (
        (ax1, "tokens_per_second", "tokens / s"),
        (ax2, "mean_acceptance_length", "mean acceptance length"),
    ):
        for r in rows:
            sps = RULES[r["rule"]].lossless
            ax.plot(r["realized_kl_mean"], r[key] or 0, "D" if sps else "o", color="black" if sps else "tab:green")
            delta = r["rule_params"].get("delta")
            ax.annotate(
                "SpS" if sps else (f"δ={delta:g}" if delta is not None else r["rule"]),
                (r["realized_kl_mean"], r[key] or 0),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
            )
        if key == "tokens_per_second" and alone is not None:
            ax.axhline(alone["tokens_per_second"], color="gray", lw=1, ls=":", label="verifier alone")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xlabel("realized KL(h_alg || q) per token (nats)")
        ax.set_ylabel(label)
    env = doc["environment"]
    fig.suptitle(
        f"{env['verifier']} / {env['draft']} · {env.get('backend', '')} · {env.get('device_name', '')}"[:120],
        fontsize=8,
    )
    _save_figure(plt, fig, path)


def print_quality(console: Console, doc: dict) -> None:
    """`cactus models quality`: one row per quantization."""
    from rich.table import Table

    table = Table(title=f"{doc['verifier']} · {doc['texts']} texts · teacher-forced", title_justify="left")
    for col in ("quantize", "weights", "mean NLL", "Δ NLL", "greedy agreement", f"within {doc['tolerance_nats']:g}"):
        table.add_column(col, justify="left" if col == "quantize" else "right")
    for r in doc["results"]:
        ref = r["quantize"] == "none"
        table.add_row(
            "none, bfloat16" if ref else r["quantize"],
            f"{r['weight_gb']:.2f} GB",
            f"{r['mean_nll']:.4f}",
            "-" if ref else f"{r['nll_vs_reference']:+.4f}",
            "-" if ref else f"{100 * r['greedy_agreement']:.1f}%",
            "-" if ref else ("yes" if r["within_tolerance"] else "no"),
        )
    console.print(table)
    console.print(
        "Δ NLL: nats per token above the unquantized model; greedy agreement: positions where both "
        "pick the same next token",
        style="dim",
    )
