"""Helpers the CLI-level tests share: a CliRunner call, the one-line-error check, the tiny pair's
arguments, waiting for a run in a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from typer.testing import CliRunner

from cactus_cli.cli.main import app
from cactus_cli.infer.backends.torch.quant import quantize
from cactus_cli.infer.kpolicy import store

runner = CliRunner()


def ctrl_c_as_in_a_terminal() -> None:
    """preexec_fn for a child that is sent SIGINT: a suite started in the background (`pytest &`,
    nohup, a script) hands its children SIGINT ignored, and Python then never raises
    KeyboardInterrupt, so a Ctrl-C test would hang or (worse) pass without testing Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def invoke(*args, **kwargs):
    """``cactus ARGS`` through Typer's CliRunner (arguments may be paths)."""
    return runner.invoke(app, [str(a) for a in args], **kwargs)


def pair_args(tiny, draft="draft"):
    return ["--verifier", tiny["verifier"], "--draft", tiny[draft], "--device", "cpu", "--dtype", "float32"]


def assert_one_line_error(result, needle):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert needle in lines[0], lines[0]


def calibrate_args(tiny):
    return ["calibrate", *pair_args(tiny, "draft_close"), "--limit", "1", "-n", "6", "--delta", "0.5", "-k", "1,2"]


def bench_args(tiny):
    return ["bench", *pair_args(tiny, "draft_close"), "--limit", "1", "-n", "6", "--rules", "sps", "-k", "2"]


def one_line_error(r, needle: str, code: int = 2) -> None:
    assert r.exit_code == code, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ") and needle in lines[-1], r.output
    assert "Traceback" not in r.output


def tiny_args(tiny, draft="draft_close"):
    return [
        "--verifier",
        tiny["verifier"],
        "--draft",
        tiny[draft],
        "--device",
        "cpu",
        "--compile",
        "off",
        "--dtype",
        "float32",
        "--quantize",
        "none",
    ]


def quantize_tiny(tiny, **kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.bfloat16)
    return model, quantize.quantize_model(model, "int8", tiny["verifier"], **kwargs)


def write_costs(path: Path, costs: dict, acceptance: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": store.SCHEMA, "key": {}, "costs": costs, "acceptance": acceptance}))


def cactus_run(args, env=None, timeout=120, **kw):
    return subprocess.run(
        [sys.executable, "-m", "cactus_cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})),
        **kw,
    )


ALIAS_BOMB = "\n".join(
    ["a: &a [x, x, x, x, x, x, x, x, x]"]
    + [
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]"
        for i in range(8)
    ]
)


def wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def decoding(home: Path) -> Callable[[], bool]:
    """True once a run has finished a generation (its step costs are saved after each one)."""
    return lambda: any((home / "costs").glob("*.json")) if (home / "costs").is_dir() else False


def listening_addresses(pid: int) -> list[str]:
    import psutil

    out = []
    for proc in [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True):
        for c in proc.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                out.append(c.laddr.ip)
    return out
