"""The fifth round's command-line part (``remeasure``): ``cactus models remeasure`` on empty and
filled stores, and what stored measurements with garbage in them (wrong types, NaN, missing
results, folders, FIFOs and dangling links named like a measurement) give the next generate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable


def cli_round(hs, home: Path) -> None:
    from tests.gguf_helpers import write_tiny_gguf

    gguf_file = write_tiny_gguf(home.parent / "fifth.gguf", seed=3)
    env = dict(os.environ, CACTUS_HOME=str(home), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    costs = home / "costs"

    def cli(name: str, args: list[str], want=0, env_over: dict | None = None, check=None, setup=None) -> None:
        if setup is not None:
            setup()
        try:
            p = subprocess.run([sys.executable, "-m", "cactus_cli", *args], env={**env, **(env_over or {})},
                               capture_output=True, timeout=180)  # fmt: skip
        except subprocess.TimeoutExpired:
            hs.record("remeasure", name, "hang", "no exit in 180 s")
            return
        err, out = p.stderr.decode("utf-8", "replace"), p.stdout.decode("utf-8", "replace")
        wants = want if isinstance(want, tuple) else (want,)
        lines = [line for line in err.strip().splitlines() if line.startswith("error")]
        problem = check(out, err) if check is not None and p.returncode == 0 else None
        if "Traceback" in err:
            hs.record("remeasure", name, "traceback", err.strip().splitlines()[-1])
        elif p.returncode not in wants:
            hs.record("remeasure", name, "wrong", f"exit {p.returncode} (expected {wants}): {err.strip()[-200:]}")
        elif p.returncode == 2 and len(lines) != 1 and "Usage" not in err:
            hs.record("remeasure", name, "wrong", f"not one error line: {err.strip()[-200:]}")
        elif problem:
            hs.record("remeasure", name, "wrong", problem)
        else:
            hs.record(
                "remeasure",
                name,
                "fine",
                f"exit {p.returncode}: {(lines or out.strip().splitlines()[-1:] or [''])[0][:140]}",
            )

    gen = ["generate", "the cat", "--verifier", str(gguf_file), "--draft", "none", "-n", "6", "--json"]

    def plan_says(out: str, err: str) -> str | None:
        plan = json.loads(out)["settings"]["plan"]
        reason = plan["threads"].get("reason") or ""
        if not plan["threads"].get("value") or "measured" not in reason:
            return f"the plan does not say how its threads were chosen: {plan['threads']}"
        return None

    def forgot(n_min: int):
        def check(out: str, err: str) -> str | None:
            n = int(out.split("forgot ")[1].split(" ")[0]) if "forgot " in out else -1
            return None if n >= n_min else f"forgot {n}, expected at least {n_min}: {out.strip()}"

        return check

    def each_record(change: Callable[[dict], None]) -> Callable[[], None]:
        def setup() -> None:
            for path in costs.glob("*.json"):
                try:
                    doc = json.loads(path.read_text())
                except (ValueError, OSError):
                    continue
                target = doc.get("result", doc)
                if isinstance(target, dict):
                    change(target)
                path.write_text(json.dumps(doc))

        return setup

    def put(name: str, data: bytes | None = None, kind: str = "file") -> Callable[[], None]:
        def setup() -> None:
            costs.mkdir(parents=True, exist_ok=True)
            path = costs / name
            if kind == "dir":
                path.mkdir(exist_ok=True)
            elif kind == "fifo":
                os.mkfifo(path)
            elif kind == "link":
                path.symlink_to(costs / "nowhere")
            else:
                path.write_bytes(data or b"")

        return setup

    cli("remeasure on an empty home", ["models", "remeasure"], 0, check=forgot(0))
    cli("a first generate on the tiny GGUF (plan says the threads)", gen, 0, check=plan_says)
    cli("remeasure after it", ["models", "remeasure"], 0, check=forgot(1))
    cli("remeasure twice", ["models", "remeasure"], 0, check=forgot(0))
    cli("generate after remeasure (measured again)", gen, 0, check=plan_says)
    cli("remeasure with an extra argument", ["models", "remeasure", "now"], 2)
    cli("remeasure --help", ["models", "remeasure", "--help"], 0)
    cli("a folder named like a measurement", ["models", "remeasure"], 0, setup=put("x.json", kind="dir"))
    cli("a FIFO named like a measurement", ["models", "remeasure"], 0, setup=put("f.json", kind="fifo"))
    cli("a dangling link named like a measurement", ["models", "remeasure"], 0, setup=put("l.json", kind="link"))
    cli("a costs folder that is a file", ["models", "remeasure"], (0, 2),
        setup=lambda: (_clear(costs), costs.write_text("x")))  # fmt: skip
    cli(
        "CACTUS_HOME a file", ["models", "remeasure"], (0, 2), env_over={"CACTUS_HOME": str(home.parent / "fifth.gguf")}
    )
    _clear(costs)
    cli("generate to fill the stores again", gen, 0, check=plan_says)
    for label, change in [
        ('"quiet": "yes"', lambda r: r.update(quiet="yes")),
        ('"taken": 5', lambda r: r.update(taken=5)),
        ('"taken" an object', lambda r: r.update(taken={"a": 1})),
        ('"cpu_share" a string', lambda r: r.update(cpu_share="x")),
        ('"curves" garbage', lambda r: r.update(curves={"2": "fast"}, scores=r.get("scores"))),
        ('"curves" a list', lambda r: r.update(curves=[1, 2])),
        ('"drift" NaN', lambda r: r.update(drift=float("nan"), quiet=False)),
        ("scores of a thread count that is not a number", lambda r: r.update(scores={"two": 1.0})),
        ('"quiet" false with no time', lambda r: (r.pop("taken", None), r.update(quiet=False))),
        ("a record without its result", lambda r: r.clear()),
    ]:
        cli(f"a stored measurement with {label}", gen, 0, check=plan_says, setup=each_record(change))
    cli("a store file of garbage bytes", gen, 0, check=plan_says, setup=put("gguf-layout-0000.json", b"\x00\xff{"))
    cli("remeasure forgets the garbage too", ["models", "remeasure"], 0, check=forgot(1))


def _clear(folder: Path) -> None:
    import shutil

    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder)
    elif folder.exists() or folder.is_symlink():
        folder.unlink()
