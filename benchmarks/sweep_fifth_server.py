"""The fifth round's server: the byte-level tiny pair served with ``--parallel`` slots, every case
of the tools, JSON and logprobs surfaces sent to it (each followed by a canary request, each 200
answer checked), then the slots round.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from sweep_fifth_cases_json import json_cases, logprob_cases
from sweep_fifth_cases_tools import tool_cases
from sweep_fifth_checks import PARALLEL, TEMPLATE, X, chat, stream_problem, streamed
from sweep_fifth_slots import slots_round


def server_cases() -> list[tuple]:
    """(surface, name, path, body, accepted statuses, check of a 200 body or None)."""
    return tool_cases() + json_cases() + logprob_cases()


def make_pair(root: Path) -> dict[str, str]:
    """The byte-level tiny pair (every character a token), its template with a tools section."""
    from tests.conftest import make_byte_pair

    return make_byte_pair(root, max_pos=2048, chat_template=TEMPLATE)


def start(hs, models: dict[str, str], parallel: int = PARALLEL, max_queue: int = 4):
    from cactus_cli.app.serve.serving import Server
    from cactus_cli.app.session import Session

    session = Session.load(
        verifier=models["verifier"], draft=models["draft"], device="cpu", dtype="float32",
        num_draft_tokens=3, temperature=0.0, seed=0, sequences=parallel,
    )  # fmt: skip
    return hs.serve(Server(session, max_queue=max_queue, parallel=parallel))


def server_round(hs, models: dict[str, str]) -> None:
    errors = hs.Errors()
    for name in ("uvicorn.error", "uvicorn", "fastapi", ""):
        logging.getLogger(name).addHandler(errors)
    server, url, stop = start(hs, models)
    canary = chat(max_tokens=12)
    base = hs.httpx.post(url + X, json=canary, timeout=60).json()["choices"][0]["message"]["content"]
    try:
        for surface, name, path, body, accept, check in server_cases():
            seen = len(errors.records)
            t0 = time.monotonic()
            try:
                if body.get("stream"):
                    status, doc = streamed(hs, url, path, {k: v for k, v in body.items() if k != "stream"})
                    text = json.dumps(doc)
                else:
                    status, text = hs._raw(url, "POST", path, body, {}, timeout=120)
                    doc = json.loads(text) if status == 200 else None
            except hs.httpx.TimeoutException:
                hs.record(surface, name, "hang", "no answer in 120 s")
                continue
            except Exception as err:  # noqa: BLE001
                hs.record(surface, name, "lost", f"{type(err).__name__}: {err}")
                continue
            took = time.monotonic() - t0
            logged = errors.records[seen:]
            try:
                after = hs.httpx.post(url + X, json=canary, timeout=60).json()["choices"][0]["message"]["content"]
            except Exception as err:  # noqa: BLE001
                hs.record(surface, name, "lost", f"canary after it: {type(err).__name__}: {err}")
                server, url, stop = start(hs, models)
                continue
            problem = None
            if status == 200 and body.get("stream"):
                problem = stream_problem(doc, body)
            elif status == 200 and check is not None:
                try:
                    problem = check(doc)
                except (KeyError, TypeError, IndexError) as err:
                    problem = f"answer not in OpenAI's shape: {type(err).__name__} {err}: {text[:160]}"
            if status >= 500 or logged:
                hs.record(surface, name, "traceback", f"{status} {text[:120]} {logged[:1]}")
            elif after != base:
                hs.record(surface, name, "lost", f"the canary's answer changed: {after!r} vs {base!r}")
            elif took > 60:
                hs.record(surface, name, "hang", f"answered after {took:.0f} s")
            elif status not in accept:
                hs.record(surface, name, "wrong", f"{status} (expected {accept}) {text[:150]}")
            elif problem:
                hs.record(surface, name, "wrong", problem)
            elif status != 200 and (bad := hs.one_line_error(status, text)):
                hs.record(surface, name, "wrong", bad)
            else:
                hs.record(surface, name, "fine", f"{status} {text[:100]}")
        slots_round(hs, url, server, errors)
    finally:
        stop()
