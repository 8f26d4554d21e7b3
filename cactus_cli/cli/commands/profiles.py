"""`cactus profiles list|show`: the built-in and user profiles."""

from __future__ import annotations

from typing import Annotated

import typer

from cactus_cli.cli.edge import user_errors
from cactus_cli.cli.ui import make_console
from cactus_cli.core.errors import CactusError

profiles_app = typer.Typer(
    help="List and show YAML profiles (model pair, rule, delta, k, sampling).", no_args_is_help=True
)


@profiles_app.command("list")
def list_cmd() -> None:
    """List every profile: built-in ones and those in the user directory."""
    with user_errors():
        from rich.table import Table

        from cactus_cli.app.config.profile_files import (
            list_profiles,
            load_profile,
            user_profile_dir,
        )

        table = Table(title="profiles", title_justify="left")
        table.add_column("name", no_wrap=True, style="bold")
        table.add_column("origin", no_wrap=True)
        table.add_column("verifier / draft", overflow="fold")
        for col in ("rule", "delta", "k"):
            table.add_column(col, no_wrap=True)

        bad = []
        for name, path, origin in list_profiles():
            try:
                data, _ = load_profile(str(path))
            except CactusError as err:  # one broken file must not hide the others
                bad.append(str(err))
                table.add_row(name, origin, "[red]invalid: see below[/]", "-", "-", "-")
                continue
            models = f"{data.get('verifier', '-')}\n{data.get('draft', '-')}"
            table.add_row(
                name,
                origin,
                models,
                str(data.get("rule", "-")),
                str(data.get("delta", "-")),
                str(data.get("num_draft_tokens", "-")),
            )
        console = make_console()
        console.print(table)
        console.print(f"user profiles: {user_profile_dir()}", style="dim")
        for problem in bad:
            from rich.text import Text

            make_console(stderr=True).print(Text.assemble(("invalid profile: ", "red"), problem), soft_wrap=True)


@profiles_app.command("show")
def show_cmd(name: Annotated[str, typer.Argument(help="Profile name or path.")]) -> None:
    """Show a profile's settings, resolved over the built-in defaults."""
    with user_errors():
        import yaml

        from cactus_cli.app.config.profile_files import load_profile
        from cactus_cli.app.config.settings import build_settings

        data, path = load_profile(name)
        settings = build_settings((data, str(path)))
        typer.echo(f"# {path}")
        typer.echo(yaml.safe_dump(settings.to_dict(), sort_keys=False).rstrip())


def register(app: typer.Typer) -> None:
    app.add_typer(profiles_app, name="profiles")
