"""The clients people use, against `cactus serve` on the embedded pair: each does a real task through
the OpenAI API, and the table says whether it worked (or its error), the wall time, the tokens it
generated, MAL, and the prompt tokens served from the KV cache.

    python -m venv /tmp/clients && /tmp/clients/bin/pip install aider-chat llm langchain-openai \\
        openai-agents smolagents
    python benchmarks/clients.py --clients-python /tmp/clients/bin/python [--only aider-whole,llm]

The clients live in their own environment (aider alone pins dozens of packages): each runs there as
a subprocess, against one server this script starts (`cactus serve --port 0`, the default profile,
greedy unless --temperature) or the one --url names. Figures come from the server's /metrics around
each client's run (vLLM's counters: generated tokens, drafts and accepted drafts; cactus's reused
prefix tokens). Offline: every client's telemetry, update checks and model-price downloads are off.
One benchmark at a time."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from urllib.request import urlopen

OFFLINE = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "HF_HUB_OFFLINE": "1",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "TELEMETRY_DISABLED": "1",
    "DO_NOT_TRACK": "1",
    "OPENAI_API_KEY": "unused",
}

EDIT_FILE = """def total(prices):
    t = 0
    for p in prices:
        t = t + p
    return t


def average(prices):
    return total(prices) / len(prices)
"""

# The agent loop through the openai client: a required call, the tool's result, then tool_choice auto.
OPENAI_LOOP = """
        from openai import OpenAI
        c = OpenAI(base_url=URL, api_key="unused")
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        if INSTRUCTED:  # (the Agents SDK's instructions below; without them the 1.5B calls the tool again)
            msgs.insert(0, {"role": "system", "content": "Call the tool to look the weather up, then tell the user the result in one sentence."})
        first = c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice="required", temperature=0)
        call = first.choices[0].message.tool_calls[0]
        msgs += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "It is sunny and 21 C in Paris."}]
        # the issue's loop: the tool's answer back, tools still declared, tool_choice auto, greedy
        then = c.chat.completions.create(model=MODEL, messages=msgs, tools=tools, tool_choice="auto", temperature=0)
        m = then.choices[0].message
        print("RESULT", json.dumps({"ok": not m.tool_calls and "21" in (m.content or ""), "call": call.function.name,
              "arguments": call.function.arguments, "answer": (m.content or "")[:120], "calls_again": bool(m.tool_calls)}))
"""

# The OpenAI Agents SDK looking the weather up with a function tool, TOOL_CHOICE and MAX_TURNS set.
AGENTS = """
        from agents import Agent, Runner, function_tool, set_tracing_disabled, OpenAIChatCompletionsModel
        from agents import ModelSettings
        from openai import AsyncOpenAI
        set_tracing_disabled(True)
        used = []
        @function_tool
        def get_weather(city: str) -> str:
            '''Current weather in a city.'''
            used.append(city)
            return f"It is sunny and 21 C in {city}."
        model = OpenAIChatCompletionsModel(model=MODEL, openai_client=AsyncOpenAI(base_url=URL, api_key="unused"))
        agent = Agent(name="weather", instructions="Call the tool to look the weather up, then tell the user the result in one sentence.", model=model, tools=[get_weather],
                      model_settings=ModelSettings(temperature=0, tool_choice=TOOL_CHOICE))
        out = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=MAX_TURNS)
        ok = bool(used) and "21" in str(out.final_output)
        print("RESULT", json.dumps({"ok": ok, "tool_args": used, "final": str(out.final_output)[:120]}))
"""

# Each client: a Python program run by the clients' interpreter (URL and MODEL set), or a command.
# It prints one line "RESULT <json>" with what it checked; anything else is the client's own output.
PROGRAMS = {
    "llm": None,  # a command line: see run_llm
    "aider-whole": None,
    "aider-diff": None,
    "langchain": """
        from langchain_openai import ChatOpenAI
        from pydantic import BaseModel
        llm = ChatOpenAI(model=MODEL, base_url=URL, api_key="unused", temperature=0, max_retries=0)
        a = llm.invoke("Name one prime number between 10 and 20. Answer with the number only.").content
        s = "".join(c.content for c in llm.stream("Say hello in French, one word."))
        def get_weather(city: str) -> str:
            '''Current weather in a city.'''
            return "sunny"
        call = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
        class Person(BaseModel):
            name: str
            born: int
        p = llm.with_structured_output(Person, method="json_schema").invoke(
            "Ada Lovelace was born in 1815. Extract the person.")
        ok = bool(a.strip()) and bool(s.strip()) and call.tool_calls and call.tool_calls[0]["name"] == "get_weather"
        ok = ok and isinstance(p, Person) and p.born == 1815
        print("RESULT", json.dumps({"ok": bool(ok), "invoke": a[:40], "stream": s[:40],
              "tool_call": call.tool_calls[0] if call.tool_calls else None, "structured": p.model_dump()}))
    """,
    "openai-agents": "        TOOL_CHOICE, MAX_TURNS = 'required', 10\n"
    + AGENTS,  # (the SDK resets it to auto after the call)
    "openai-loop-auto": "        INSTRUCTED = False\n" + OPENAI_LOOP,  # (the loop, as it was sent)
    "openai-loop-auto-instructed": "        INSTRUCTED = True\n" + OPENAI_LOOP,
    "openai-agents-auto": "        TOOL_CHOICE, MAX_TURNS = None, 4\n"
    + AGENTS,  # (tool_choice left at auto, as agents do)
    "langchain-loop-auto": """
        from langchain_core.messages import HumanMessage, ToolMessage
        from langchain_openai import ChatOpenAI
        def get_weather(city: str) -> str:
            '''Current weather in a city.'''
            return f"It is sunny and 21 C in {city}."
        llm = ChatOpenAI(base_url=URL, api_key="unused", model=MODEL, temperature=0).bind_tools([get_weather])
        msgs, calls = [HumanMessage("What is the weather in Paris? Use the tool.")], 0
        for _ in range(4):
            ai = llm.invoke(msgs)
            msgs.append(ai)
            if not ai.tool_calls:
                break
            for tc in ai.tool_calls:
                calls += 1
                msgs.append(ToolMessage(get_weather(**tc["args"]), tool_call_id=tc["id"]))
        print("RESULT", json.dumps({"ok": calls > 0 and "21" in str(ai.content), "calls": calls,
              "final": str(ai.content)[:120]}))
    """,
    "smolagents-tools": """
        from smolagents import OpenAIServerModel, ToolCallingAgent, tool
        @tool
        def multiply(a: int, b: int) -> int:
            '''Multiply two integers.

            Args:
                a: the first integer
                b: the second integer
            '''
            return a * b
        model = OpenAIServerModel(model_id=MODEL, api_base=URL, api_key="unused", temperature=0)
        agent = ToolCallingAgent(tools=[multiply], model=model, max_steps=4, verbosity_level=0)
        out = agent.run("What is 17 times 23? Use the multiply tool.")
        print("RESULT", json.dumps({"ok": "391" in str(out), "final": str(out)[:120]}))
    """,
    "smolagents-code": """
        from smolagents import OpenAIServerModel, CodeAgent
        model = OpenAIServerModel(model_id=MODEL, api_base=URL, api_key="unused", temperature=0)
        agent = CodeAgent(tools=[], model=model, max_steps=4, verbosity_level=0)
        out = agent.run("Compute the sum of the squares of the integers from 1 to 10.")
        steps = agent.memory.steps
        errors = [str(getattr(s, "error", "")) for s in steps if getattr(s, "error", None)]
        parse = [e for e in errors if "parsing" in e.lower() or "SyntaxError" in e]
        print("RESULT", json.dumps({"ok": "385" in str(out) and not parse, "final": str(out)[:120],
              "step_errors": [e[:160] for e in errors]}))
    """,
}


def metrics(url: str) -> dict[str, float]:
    text = urlopen(url.removesuffix("/v1") + "/metrics", timeout=30).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_:]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def window(before: dict, after: dict) -> dict:
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    drafts = d.get("vllm:spec_decode_num_drafts_total", 0)
    accepted = d.get("vllm:spec_decode_num_accepted_tokens_total", 0)
    return {
        "tokens": int(d.get("vllm:generation_tokens_total", 0)),
        "requests": int(d.get("vllm:request_success_total", 0)),
        "mal": round(1 + accepted / drafts, 2) if drafts else None,
        "cached_prompt_tokens": int(d.get("cactus_reused_prefix_tokens_total", 0)),
    }


def run_program(py: str, name: str, url: str, model: str, timeout: int) -> tuple[bool, str, dict]:
    code = "import json\nURL = %r\nMODEL = %r\n" % (url, model) + textwrap.dedent(PROGRAMS[name])
    script = Path(tempfile.mkdtemp(prefix="client-")) / f"{name.replace('-', '_')}.py"
    script.write_text(code)  # (a file, not -c: smolagents reads its tools' source)
    proc = subprocess.run(
        [py, str(script)], capture_output=True, text=True, timeout=timeout, env={**os.environ, **OFFLINE}
    )
    return parse(proc)


def parse(proc: subprocess.CompletedProcess) -> tuple[bool, str, dict]:
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if found:
        detail = json.loads(found[-1][7:])
        return bool(detail.get("ok")), "" if detail.get("ok") else json.dumps(detail)[:300], detail
    tail = (proc.stderr or proc.stdout).strip().splitlines()
    return False, (tail[-1] if tail else f"exit {proc.returncode}")[:300], {}


def run_llm(py: str, url: str, model: str, timeout: int) -> tuple[bool, str, dict]:
    home = Path(tempfile.mkdtemp(prefix="llm-"))
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: cactus\n  model_name: {model}\n  api_base: {url}\n  api_key_name: cactus\n"
    )
    (home / "keys.json").write_text(json.dumps({"cactus": "unused"}))
    exe = str(Path(py).parent / "llm")
    prompt = "Explain in about 400 words how a hash table works, with an example."
    proc = subprocess.run(
        [exe, "-m", "cactus", "-o", "temperature", "0", prompt],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **OFFLINE, "LLM_USER_PATH": str(home)},
    )
    text = proc.stdout.strip()
    words = len(text.split())
    ok = proc.returncode == 0 and words > 200  # (the 256-token cut ended it near 190 words)
    return ok, "" if ok else (proc.stderr.strip().splitlines() or [f"{words} words"])[-1][:300], {"words": words}


def run_aider(py: str, url: str, model: str, timeout: int, fmt: str) -> tuple[bool, str, dict]:
    work = Path(tempfile.mkdtemp(prefix="aider-"))
    target = work / "prices.py"
    target.write_text(EDIT_FILE)
    exe = str(Path(py).parent / "aider")
    message = (
        "In prices.py, make average() return 0.0 for an empty list instead of failing, "
        "and add a docstring to each function."
    )
    cmd = [
        exe, "--model", f"openai/{model}", "--openai-api-base", url, "--openai-api-key", "unused",
        "--edit-format", fmt, "--yes-always", "--no-git", "--no-check-update", "--analytics-disable",
        "--no-show-model-warnings", "--map-tokens", "0", "--no-stream", "--no-auto-lint", "--no-pretty",
        "--message", message, str(target),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **OFFLINE}, cwd=work)
    after = target.read_text()
    changed = after != EDIT_FILE
    try:
        ns: dict = {}
        exec(compile(after, "prices.py", "exec"), ns)  # noqa: S102 (the file aider wrote, in a temp folder)
        works = ns["average"]([]) == 0.0 and ns["average"]([1, 3]) == 2
    except Exception as err:  # noqa: BLE001
        works = False
        after += f"\n# {type(err).__name__}: {err}"
    limit = "token limit" in proc.stdout + proc.stderr
    ok = changed and works and not limit
    why = "" if ok else ("hit a token limit" if limit else ("file unchanged" if not changed else "edit applied, wrong"))
    return ok, why, {"applied": changed, "works": works, "log_tail": (proc.stdout + proc.stderr)[-400:]}


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "cactus_cli", "serve", "--port", str(args.port)]
    cmd += ["--temperature", str(args.temperature)] + (["--profile", args.profile] if args.profile else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{args.port}/v1"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"cactus serve exited: {proc.stderr.read()[-2000:]}")
        try:
            urlopen(url.removesuffix("/v1") + "/health", timeout=2)
            return proc, url
        except OSError:
            time.sleep(1)
    proc.kill()
    raise SystemExit("cactus serve did not come up in 15 minutes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients-python", default=sys.executable, help="the interpreter the clients are installed for")
    ap.add_argument("--url", default=None, help="a running server's /v1 URL (default: start one)")
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--only", default=None, help="comma-separated client names")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per client")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(PROGRAMS)
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        model = json.loads(urlopen(url + "/models", timeout=30).read())["data"][0]["id"]
        rows = []
        print("| client | result | wall s | tokens | requests | MAL | cached prompt tokens |")
        print("|---|---|---|---|---|---|---|")
        for name in names:
            before, t0 = metrics(url), time.perf_counter()
            try:
                if name == "llm":
                    ok, why, detail = run_llm(args.clients_python, url, model, args.timeout)
                elif name.startswith("aider"):
                    ok, why, detail = run_aider(args.clients_python, url, model, args.timeout, name.split("-")[1])
                else:
                    ok, why, detail = run_program(args.clients_python, name, url, model, args.timeout)
            except subprocess.TimeoutExpired:
                ok, why, detail = False, f"timed out after {args.timeout} s", {}
            wall = time.perf_counter() - t0
            w = window(before, metrics(url))
            rows.append({"client": name, "ok": ok, "why": why, "wall_s": round(wall, 1), **w, "detail": detail})
            result = "works" if ok else f"fails: {why}"
            print(
                f"| {name} | {result} | {wall:.1f} | {w['tokens']} | {w['requests']} | {w['mal']} | "
                f"{w['cached_prompt_tokens']} |",
                flush=True,
            )
        if args.out:
            args.out.write_text(json.dumps(rows, indent=2))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
