"""The fifth round's slots and concurrency (``slots``): greedy answers sent together equal the same
requests' answers alone (mixed lengths, shared prefixes, streams, rules, k, seeds, JSON, calls,
logprobs), dropped streams and queued requests free their slots, a burst past the queue, /metrics
while requests run, and no threads or descriptors left behind.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

from sweep_fifth_checks import PARALLEL, PET, TOOLS, C, X, chat, comp, forced, json_answer, schema_fmt, streamed


def run_all(threads: list[threading.Thread], seconds: float = 240) -> None:
    """Start every thread, then wait for each (at most ``seconds``)."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds)


def together(hs, url: str, requests: list[tuple[str, dict]], stream: list[bool] | None = None) -> list[Any]:
    """Send every request at once (threads), each answer or the exception it raised, in order."""
    out: list[Any] = [None] * len(requests)
    stream = stream or [False] * len(requests)

    def go(i: int) -> None:
        path, body = requests[i]
        try:
            if stream[i]:
                out[i] = streamed(hs, url, path, body)[1]
            else:
                out[i] = hs.httpx.post(url + path, json=body, timeout=180).json()
        except Exception as err:  # noqa: BLE001
            out[i] = err

    run_all([threading.Thread(target=go, args=(i,)) for i in range(len(requests))])
    return out


def answer_problem(check: Callable[[dict], str | None], doc: Any) -> str | None:
    """What is wrong with one answer of several sent together (an error answer included)."""
    if not isinstance(doc, dict) or "choices" not in doc:
        return f"no answer: {str(doc)[:160]}"
    return check(doc)


def text_of(doc: Any) -> str | None:
    if isinstance(doc, dict) and "choices" in doc:
        ch = doc["choices"][0]
        return ch["message"]["content"] if "message" in ch else ch["text"]
    if isinstance(doc, dict) and "text" in doc:
        return doc["text"]
    return None


def alone_vs_together(hs, url: str, name: str, requests: list[tuple[str, dict]], stream: list[bool] | None = None):
    alone = [text_of(hs.httpx.post(url + p, json=b, timeout=180).json()) for p, b in requests]
    both = [text_of(d) for d in together(hs, url, requests, stream)]
    bad = [i for i, (a, b) in enumerate(zip(alone, both)) if a != b or a is None]
    hs.record("slots", name, "fine" if not bad else "wrong",
              f"{len(requests)} requests, all equal alone" if not bad else f"request {bad[0]}: {both[bad[0]]!r} vs {alone[bad[0]]!r}")  # fmt: skip


def wait_idle(server, seconds: float = 20) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not server_busy(server):
            return True
        time.sleep(0.05)
    return False


def server_busy(server) -> bool:
    return bool(server.running) or server.queue.qsize() > 0


def slots_round(hs, url: str, server, errors) -> None:
    g = lambda p, n, **kw: (C, comp(p, max_tokens=n, **kw))  # noqa: E731
    prompts = [
        "the cat",
        "the cat sat on",
        "the dog ran",
        "the mat and the dog",
        "cat dog bird",
        "the",
        "sat on the mat",
        "the cat sat on the mat and",
    ]
    alone_vs_together(hs, url, "8 greedy requests of mixed lengths", [g(p, 8 + 6 * i) for i, p in enumerate(prompts)])
    shared = "the cat sat on the mat and the dog ran fast " * 3
    alone_vs_together(hs, url, "8 sharing a prefix, some with stop strings",
                      [g(shared + p, 20, **({"stop": [" the"]} if i % 2 else {})) for i, p in enumerate(prompts)])  # fmt: skip
    alone_vs_together(hs, url, "4 streamed", [g(p, 20) for p in prompts[:4]], [True] * 4)
    alone_vs_together(hs, url, "4 streamed and 4 whole", [g(p, 16) for p in prompts], [i % 2 == 0 for i in range(8)])
    rules = [{"rule": "sps"}, {"rule": "cactus", "delta": 1.0}, {"rule": "tas"}, {"rule": "cactus-exact", "delta": 0.5}]
    alone_vs_together(hs, url, "4 rules side by side", [g("the cat", 20, **r) for r in rules])
    ks = [{"num_draft_tokens": k} for k in (1, 2, 4, "auto")]
    alone_vs_together(hs, url, "k 1, 2, 4 and auto side by side", [g("the dog ran", 20, **k) for k in ks])
    alone_vs_together(
        hs,
        url,
        "draft none beside drafting requests",
        [g("the cat sat", 20, **({"draft": "none"} if i == 0 else {})) for i in range(4)],
    )
    seeded = [g("the cat", 20, temperature=0.8, seed=s) for s in (1, 2, 3, 4)]
    alone_vs_together(hs, url, "4 seeded samples at T 0.8", seeded)
    alone_vs_together(hs, url, "the same request 4 times", [g("the mat", 20)] * 4)
    mixed = [
        (X, chat(response_format=schema_fmt(PET), max_tokens=200)),
        (X, chat(tools=TOOLS, tool_choice="required")),
        (X, chat(logprobs=True, top_logprobs=3)),
        g("the cat", 20),
    ]
    alone_vs_together(hs, url, "JSON, a forced call, logprobs and plain text together", mixed)
    docs = together(
        hs, url, [(X, chat(response_format=schema_fmt(PET), temperature=1.0, seed=s, max_tokens=200)) for s in range(4)]
    )
    bad = [d for d in docs if answer_problem(json_answer(PET), d)]
    hs.record("slots", "4 sampled JSON answers together", "fine" if not bad else "wrong", str(bad[:1])[:200])
    docs = together(
        hs,
        url,
        [(X, chat(tools=TOOLS, tool_choice="required", temperature=1.0, seed=s, max_tokens=120)) for s in range(4)],
    )
    bad = [d for d in docs if answer_problem(forced(TOOLS), d)]
    hs.record("slots", "4 sampled forced calls together", "fine" if not bad else "wrong", str(bad[:1])[:200])
    # speculation stays alive after a draft-less request in a slot
    together(hs, url, [g("the cat sat on the mat", 30, draft="none")] * 4)
    docs = together(hs, url, [g("the cat sat on the mat", 30)] * 4)
    spec = [d.get("speculative", {}) for d in docs if isinstance(d, dict)]
    kept = sum(s.get("accepted") or 0 for s in spec)
    hs.record(
        "slots",
        "drafting after draft-less requests in every slot",
        "fine" if kept > 0 else "wrong",
        f"accepted {kept}: {spec[:1]}",
    )
    cancel_round(hs, url, server)
    burst(hs, url, server)
    metrics_round(hs, url, server)
    over = together(hs, url, [g("the " * 3000, 4), g("the cat", 16), g("the dog", 16), g("the mat", 16)])
    ok = (
        isinstance(over[0], dict)
        and "error" in over[0]
        and all(isinstance(d, dict) and text_of(d) is not None for d in over[1:])
    )
    hs.record("slots", "a prompt past the context beside three others", "fine" if ok else "wrong", str(over[0])[:160])
    answers = together(
        hs, url, [(C, {"prompt": "the cat", "temperature": 0}), g("the cat", 8), g("the dog", 8), g("the mat", 8)]
    )
    ok = all(isinstance(d, dict) and d["choices"][0]["finish_reason"] in ("stop", "length") for d in answers)
    hs.record("slots", "one without max_tokens (to its end) beside three short", "fine" if ok else "wrong",
              f"{[d['usage']['completion_tokens'] if isinstance(d, dict) and 'usage' in d else d for d in answers]}")  # fmt: skip
    docs = together(hs, url, [g("the cat sat", 24)] * 4)
    bad = [d for d in docs if not isinstance(d, dict) or not isinstance(s := d.get("speculative"), dict)
           or not 1 <= s["verifier_forward_passes"] <= d["usage"]["completion_tokens"] + 1
           or not 0 <= s["accepted"] <= s["drafted"]]  # fmt: skip
    hs.record("slots", "each answer's speculative object its own", "fine" if not bad else "wrong", str(bad[:1])[:200])
    time.sleep(1.0)
    before = threading.active_count(), len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        together(hs, url, [g(p, 12) for p in prompts])
        cancel_round(hs, url, server, say=False)
    time.sleep(1.0)
    after = threading.active_count(), len(os.listdir("/proc/self/fd"))
    hs.record("slots", "threads and fds after two more rounds of 8 and of cancels",
              "fine" if after[0] <= before[0] + 2 and after[1] <= before[1] + 2 else "leak", f"{before} -> {after}")  # fmt: skip


def cancel_round(hs, url: str, server, say: bool = True) -> None:
    """One stream dropped after its first chunk while three others run; then four dropped at once."""
    body = comp("the cat", max_tokens=200, temperature=0.9, stream=True)

    def drop():
        with hs.httpx.stream("POST", url + C, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break

    others = [(C, comp(p, max_tokens=16)) for p in ("the cat", "the dog", "the mat")]
    alone = [text_of(hs.httpx.post(url + p, json=b, timeout=60).json()) for p, b in others]
    t = threading.Thread(target=drop)
    t.start()
    both = [text_of(d) for d in together(hs, url, others)]
    t.join(60)
    if say:
        hs.record(
            "slots", "a stream dropped beside three answers", "fine" if both == alone else "wrong", f"{both} vs {alone}"
        )
    run_all([threading.Thread(target=drop) for _ in range(4)], 60)
    idle = wait_idle(server)
    if say:
        hs.record("slots", "four streams dropped at once free their slots", "fine" if idle else "leak", f"idle={idle}")
    run_all([threading.Thread(target=lambda: _quick_drop(hs, url)) for _ in range(8)], 60)  # (some while queued)
    idle = wait_idle(server)
    if say:
        hs.record(
            "slots", "eight whole requests dropped, some while queued", "fine" if idle else "leak", f"idle={idle}"
        )


def _quick_drop(hs, url: str) -> None:
    try:
        hs.httpx.post(url + C, json=comp("the cat", max_tokens=200, temperature=0.9), timeout=0.3)
    except hs.httpx.TimeoutException:
        pass


def burst(hs, url: str, server) -> None:
    docs = []

    def go(i):
        try:
            docs.append(hs.httpx.post(url + C, json=comp("the cat", max_tokens=6, seed=i), timeout=180).status_code)
        except Exception:  # noqa: BLE001
            docs.append(-1)

    run_all([threading.Thread(target=go, args=(i,)) for i in range(40)])
    ok = len(docs) == 40 and all(s in (200, 503) for s in docs) and docs.count(200) >= PARALLEL
    hs.record("slots", f"40 requests at once, {PARALLEL} slots, a queue of 4", "fine" if ok else "lost",
              f"200: {docs.count(200)}, 503: {docs.count(503)}, other: {[s for s in docs if s not in (200, 503)]}")  # fmt: skip


def metrics_round(hs, url: str, server) -> None:
    seen: list[tuple[float, float]] = []
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            text = hs.httpx.get(url + "/metrics", timeout=10).text
            vals = {}
            for line in text.splitlines():
                if line.startswith(
                    (
                        "cactus:num_requests_running",
                        "cactus:num_requests_waiting",
                        "vllm:num_requests_running",
                        "vllm:num_requests_waiting",
                    )
                ):
                    vals[line.split("{")[0].split(" ")[0].split(":")[1]] = float(line.rsplit(" ", 1)[1])
            seen.append((vals.get("num_requests_running", -1), vals.get("num_requests_waiting", -1)))
            time.sleep(0.05)

    t = threading.Thread(target=poll)
    t.start()
    together(hs, url, [(C, comp(p, max_tokens=24)) for p in ("the cat", "the dog", "the mat", "cat", "dog", "mat")])
    wait_idle(server)
    time.sleep(0.3)
    stop.set()
    t.join(10)
    peak = max((r for r, _ in seen), default=-1)
    last = seen[-1] if seen else (-1, -1)
    ok = 1 <= peak <= PARALLEL and last == (0, 0) and all(w >= 0 for _, w in seen)
    hs.record(
        "slots",
        "/metrics running and waiting during 6 requests, then 0",
        "fine" if ok else "wrong",
        f"peak {peak}, last {last}",
    )
