"""One module per command; each exposes ``register(app)``. Commands never import each other
(what bench and eval share is cli/grid_options.py). Keep these imports light: `cactus --help` imports
them all and must not import torch, so a command imports the app layer inside its function."""

from __future__ import annotations

import typer

from cactus_cli.cli.commands import (
    bench,
    calibrate,
    chat,
    eval,
    generate,
    models,
    profiles,
    serve,
)


def register(app: typer.Typer) -> None:
    for module in (generate, chat, serve, bench, eval, calibrate, profiles, models):
        module.register(app)
