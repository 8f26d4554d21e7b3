"""Which GGUF weight types and how many threads make a llama.cpp verify cheapest per token on
this CPU: the ``--quantize`` and ``--threads`` choices of the llama.cpp backend.

A verify of w tokens costs 3x to 9x one token on a CPU, and which weight type's kernels are
flattest depends on the CPU and its buffers (docs/llama-cpp.md): on an AMD EPYC with repacked
kernels, Q4_0 in every tensor verified 16 tokens for 3.5x one where the shipped Q4_K_M took
7.7x; on an AMX Xeon with plain buffers Q4_K_M is the flatter of the two past 8 tokens. So:

- ``quantize none``: the GGUF as given (``--verifier FILE.gguf`` is always used as given unless
  ``--quantize q4_0`` is asked for).
- ``quantize q4_0``: requantized once, every tensor to Q4_0, by llama.cpp's own quantizer
  through the bindings (``requantize``), cached beside the models with its SHA-256.
- ``quantize auto`` (the embedded verifier): the shipped file or its Q4_0 requantization,
  whichever ``score`` says decodes edits faster here, provided its mean NLL on the calibration
  text is within QUALITY_TOLERANCE of the shipped file's; measured once per CPU and cached.
- ``threads`` not given: 1, 2 and the CPUs this process may use are timed on the verifier and
  the fastest kept (also once per CPU, cached).

``score``: seconds for 100 tokens of an edit as the built-in edit prompts decode them (measured:
about 15 tokens from plain steps, 85 from free drafts accepted 97% per token), each drafted
stretch verified at the width with the fewest seconds per expected token.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

import torch

from cactus_cli.core.conditions import Conditions, Watch, taken
from cactus_cli.core.errors import ModelError, warn
from cactus_cli.core.fileio import atomic_write
from cactus_cli.core.paths import cache_path
from cactus_cli.infer.backends.llama_cpp import gguf
from cactus_cli.infer.backends.llama_cpp.runner import LlamaCppRunner
from cactus_cli.infer.load.devices import device_name
from cactus_cli.infer.load.embedded import models_dir, remove_stale_work
from cactus_cli.infer.load.sources import LoadedModel

QUALITY_TOLERANCE = 0.02  # nats/token of mean NLL a requantized verifier may cost to be chosen
TYPES = {"q4_0": 2}  # --quantize values of the llama.cpp backend -> llama.cpp's ftype (every tensor in it)
# verify widths timed per candidate: plain, short drafts (and the runner's padding), a long one, the longest
WIDTHS = (1, 2, 3, 4, 16, 64)
THREAD_WIDTHS = (1, 16)  # ... and per thread count (a plain step and a long draft rank them; 1 thread is slow)
CONTEXT = 64  # tokens in the cache while timing (a synthetic prompt)
PLAIN_SHARE, DRAFT_ACCEPT = 15, 0.97  # the edit profile score() prices (docs/llama-cpp.md)
SCHEMA = 2  # (2: curves hold widths 2 and 3, which the runner pads from)


@dataclass(frozen=True)
class Layout:
    """What the llama.cpp verifier runs: a GGUF file, the threads, and why."""

    path: str
    threads: int
    quantize: str  # "gguf" (the file's own types) or a TYPES key
    reason: str  # why these weight types
    threads_reason: str = ""  # why this many threads ("" when given)


def expected_tokens(a: float, k: int) -> float:
    return (1 - a ** (k + 1)) / (1 - a)


def score(curve: dict[int, float]) -> float:
    """Seconds for 100 tokens of an edit under ``curve`` (width -> seconds per verify)."""
    per_drafted = min(t / expected_tokens(DRAFT_ACCEPT, w - 1) for w, t in curve.items())
    return PLAIN_SHARE * curve[1] + (100 - PLAIN_SHARE) * per_drafted


def requantize(src: Path, quantize: str, name: str, reporter=None) -> Path:
    """``src`` with every tensor in ``quantize`` (a TYPES key), made once by llama.cpp's
    quantizer and cached as ``<models>/<name>-<quantize>.gguf`` beside a JSON record of its
    source, size and SHA-256; renamed into place only when complete, so a killed run never
    leaves a half-written model. A file whose size disagrees with its record is made again; one
    changed since it was written (its mtime) is hashed, and made again unless the hash agrees."""
    out = models_dir() / f"{name}-{quantize}.gguf"
    record = out.with_name(out.name + ".json")
    if out.is_dir():
        raise ModelError(f"{out} is a folder where cactus keeps a requantized model; remove it and run again")
    if out.parent.is_dir():
        remove_stale_work(out.parent)  # (what a killed run left, even when the cached file is good)
    try:
        doc = json.loads(record.read_text(encoding="utf-8"))
        st = out.stat() if out.is_file() else None
        if st is not None and st.st_size == doc["bytes"]:
            if st.st_mtime_ns == doc.get("mtime_ns"):
                return out
            if _sha256(out) == doc["sha256"]:  # (copied or touched, not changed: trusted from now on)
                atomic_write(record, json.dumps({**doc, "mtime_ns": st.st_mtime_ns}, indent=1))
                return out
        warn(f"{out.name} does not match its record; requantizing it")
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError):
        warn(f"{record.name} is unreadable; requantizing {out.name}")
    ll = gguf.bindings()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_work(out.parent)
    if reporter is not None:
        reporter.task(f"requantizing {name} to {quantize.upper()} (llama.cpp's quantizer, once)")
    t0 = time.perf_counter()
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{out.stem}-{os.getpid()}-", suffix=".gguf", dir=out.parent)
    os.close(fd)
    try:
        params = ll.llama_model_quantize_default_params()
        params.ftype = TYPES[quantize]
        params.pure = True  # every tensor, the output and embeddings too: one kernel family for every matmul
        params.allow_requantize = True
        params.nthread = gguf.default_threads()
        if ll.llama_model_quantize(str(src).encode(), tmp.encode(), ctypes.byref(params)) != 0:
            raise ModelError(f"llama.cpp could not requantize {src} to {quantize} ({gguf.last_log() or 'no reason'})")
        digest = _sha256(Path(tmp))
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    atomic_write(
        record,
        json.dumps(
            {
                "source": str(src),
                "type": quantize,
                "bytes": out.stat().st_size,
                "mtime_ns": out.stat().st_mtime_ns,
                "sha256": digest,
                "llama_cpp_python": _bindings_version(),
                "seconds": round(time.perf_counter() - t0, 1),
            },
            indent=1,
        ),
    )
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _bindings_version() -> str | None:
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


def measure(path: str, threads: int, widths: tuple[int, ...] = WIDTHS, texts: list[list[int]] = ()) -> dict:
    """Seconds per verify at each width (the fastest of two after a warm-up; a synthetic
    ``CONTEXT``-token prompt in the cache) on ``threads`` threads, and the mean NLL per token of
    ``texts`` (token ids; None when none are given)."""
    model = gguf.GGUFModel.load(path, threads)
    lm = LoadedModel(model, path, path, torch.device("cpu"), torch.float32, model.n_ctx_train, model.n_vocab)
    context = min(CONTEXT, model.n_ctx_train // 4)  # (a model with a short window: a shorter prompt, narrower widths)
    widths = tuple(w for w in widths if context + w < model.n_ctx_train) or (1,)
    texts = [t[: model.n_ctx_train] for t in texts]
    longest = max((len(t) for t in texts), default=0)
    room = min(max(context + max(widths), longest) + 1, model.n_ctx_train)
    runner = LlamaCppRunner(lm, model.n_vocab, room)
    try:
        ids = [(7 + 31 * i) % model.n_vocab for i in range(context + max(widths))]
        runner.reserve(room, (max(max(widths), longest),))
        runner.forward(ids[: context + 1], keep=1)  # (the second call below is the warm-up)
        runner.crop(context)
        runner.forward(ids[context : context + 1], keep=1)
        runner.crop(context)
        curve = {}
        for w in widths:
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                runner.forward(ids[context : context + w], keep=w)
                times.append(time.perf_counter() - t0)
                runner.crop(context)
            curve[w] = min(times)
        total = count = 0.0
        for text in (t for t in texts if len(t) > 1):
            runner.reset()
            logits = runner.forward(text[:-1], keep=len(text) - 1).float()
            total += float(torch.nn.functional.cross_entropy(logits, torch.tensor(text[1:]), reduction="sum"))
            count += len(text) - 1
        return {"curve": curve, "nll": total / count if count else None}
    finally:
        runner.close()
        model.close()


def thread_candidates() -> list[int]:
    """1, 2 and every CPU this process may use (those that exist)."""
    n = gguf.default_threads()
    return sorted({t for t in (1, 2, n) if t <= n})


def choose(
    path: Path,
    name: str,
    quantize: str,
    threads: int | None,
    shipped: bool,
    texts: Callable[[], list[list[int]]],
    reporter=None,
) -> Layout:
    """The verifier file and threads for the llama.cpp backend (see the module docstring).
    ``shipped``: ``path`` is an embedded model (``auto`` may requantize it); ``texts``: token ids
    of the text quality is measured on (the built-in prompts), asked for only when it is."""
    if quantize in TYPES:
        path = requantize(path, quantize, name, reporter)
        n, why, records = _threads(path, f"{name}-{quantize}", threads, reporter)
        _watch(path, n, records)
        return Layout(str(path), n, quantize, "as asked (requantized once by llama.cpp)", why)
    if quantize == "auto" and shipped:
        return _auto(path, name, threads, texts, reporter)
    n, why, records = _threads(path, name, threads, reporter)
    _watch(path, n, records)
    return Layout(str(path), n, "gguf", "llama.cpp runs the GGUF's own weight types", why)


_WATCHES: dict[tuple[str, int], Watch] = {}  # (file, threads) -> the watch on its verifies, set by choose()
Record = tuple[dict[str, Any], dict[str, Any], dict]  # a stored measurement: key, result, the chosen curve


def watch_for(path: str, threads: int) -> Watch | None:
    """The watch on the verifies of ``path`` on ``threads`` threads, where stored measurements chose them."""
    return _WATCHES.get((str(path), threads))


def _watch(path: Path, threads: int, records: list[Record]) -> None:
    """Hold later verifies of ``path`` against the curve of the last of ``records`` (the measurements
    its choice was made from); beaten persistently, each is stored as provisional."""
    if not records:
        return

    def mark(ratio: float) -> None:
        for key, result, _ in records:
            _store(key, {**result, "quiet": False, "drift": round(ratio, 3)})

    try:
        curve = {int(w): float(t) for w, t in records[-1][2].items()}
    except (TypeError, ValueError, AttributeError):
        return  # (a record from before curves were kept: nothing to hold live timings against)
    _WATCHES[(str(path), threads)] = Watch("llama.cpp verifies", curve, records[-1][1], mark)


def _key(path: Path, name: str, what: str) -> dict[str, Any]:
    return {
        "what": what,
        "model": name,
        "bytes": path.stat().st_size,
        "cpu": device_name(torch.device("cpu")),
        "cpus": gguf.default_threads(),
        "llama_cpp_python": _bindings_version(),
        "buffers": gguf.buffer_layout(),  # (the kernels the weights run on: what was timed)
        "schema": SCHEMA,
    }


def _cached(key: dict[str, Any]) -> dict | None:
    path = cache_path(key, "gguf-layout-")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return doc["result"] if doc.get("key") == key and isinstance(doc["result"], dict) else None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        warn(f"the layout cache {path} is unreadable; measuring again and replacing it")
        return None


def _store(key: dict[str, Any], result: dict) -> None:
    path = cache_path(key, "gguf-layout-")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"key": key, "result": result}, indent=1))
    except OSError:
        pass  # not cached: the next run measures again


def _threads(path: Path, name: str, threads: int | None, reporter=None) -> tuple[int, str, list[Record]]:
    """(threads, why, the stored measurement it came from): as given, else the count with the best
    edit score on this file, timed once per CPU."""
    if threads:
        return threads, "", []
    candidates = thread_candidates()
    if len(candidates) == 1:
        return candidates[0], "", []
    key = _key(path, name, "threads")
    result = _cached(key)
    try:
        scores = {int(t): float(s) for t, s in result["scores"].items()} if result else None
    except (KeyError, TypeError, ValueError, AttributeError):
        scores = None
    if scores and not all(0 < s < math.inf for s in scores.values()):  # (0, negative, NaN: corrupt)
        scores = None
    again = result is not None and result.get("quiet") is False  # (provisional: taken while the machine was busy)
    if not scores or set(scores) != set(candidates) or again:
        if reporter is not None:
            why = "again: the last timing ran beside another busy process" if again else "once on this CPU"
            reporter.task(f"timing {name} on {', '.join(map(str, candidates))} threads ({why})")
        watch = Conditions.start()
        curves = {t: watch.measure(t, lambda t=t: measure(str(path), t, THREAD_WIDTHS))["curve"] for t in candidates}
        scores = {t: score(c) for t, c in curves.items()}
        result = {"scores": {str(t): s for t, s in scores.items()}, "curves": {str(t): c for t, c in curves.items()}}
        result |= watch.finish()
        _store(key, result)
    best = min(scores, key=scores.get)
    others = ", ".join(
        f"{t} thread{'s' if t > 1 else ''} take{'' if t > 1 else 's'} {scores[t] / scores[best]:.2f}x"
        for t in sorted(scores)
        if t != best
    )
    curves = result.get("curves")
    record = (key, result, curves.get(str(best)) if isinstance(curves, dict) else None)
    return best, f"{best} threads, measured fastest here ({others}; {taken(result)})", [record]


def _auto(path: Path, name: str, threads: int | None, texts: Callable[[], list[list[int]]], reporter=None) -> Layout:
    """The shipped file or its Q4_0 requantization, whichever decodes edits faster here at equal
    quality (the NLL only measured when Q4_0 is the faster); once per CPU. A requantization this
    CPU does not use is not kept."""
    n, twhy, records = _threads(path, name, threads, reporter)
    key = {**_key(path, name, "type"), "threads": n}
    result = _cached(key)
    if result is None or not _valid_type(result) or result.get("quiet") is False:
        made = requantize(path, "q4_0", name, reporter)
        if reporter is not None:
            why = "again: the last timing ran beside another busy process" if result else "once on this CPU"
            reporter.task(f"timing {name} as shipped and as Q4_0 on {n} threads ({why})")
        watch = Conditions.start()
        shipped = watch.measure(n, lambda: measure(str(path), n), "shipped")
        q40 = watch.measure(n, lambda: measure(str(made), n), "q4_0")
        faster = score(shipped["curve"]) / score(q40["curve"])
        drift = None
        if faster > 1:
            if reporter is not None:
                reporter.task("measuring Q4_0's quality on the built-in prompts (once on this CPU)")
            ids = texts()
            drift = measure(str(made), n, (1,), ids)["nll"] - measure(str(path), n, (1,), ids)["nll"]
        use = "q4_0" if drift is not None and drift <= QUALITY_TOLERANCE else "gguf"
        result = {"quantize": use, "speedup": faster, "nll_drift": drift, "shipped": shipped["curve"]}
        result |= {"q4_0": q40["curve"], **watch.finish()}
        _store(key, result)
        if reporter is not None:
            reporter.done(f"verifier {name}: {'Q4_0' if use == 'q4_0' else 'as shipped'}; {_measured(result)}")
        if use != "q4_0":  # (a GB this CPU does not use; made again only if asked for)
            for f in (made, made.with_name(made.name + ".json")):
                f.unlink(missing_ok=True)
    records.append((key, result, result.get("q4_0" if result["quantize"] == "q4_0" else "shipped")))
    if result["quantize"] == "q4_0":
        made = requantize(path, "q4_0", name, reporter)
        _watch(made, n, records)
        return Layout(str(made), n, "q4_0", f"quantize auto: Q4_0, requantized once; {_measured(result)}", twhy)
    _watch(path, n, records)
    return Layout(str(path), n, "gguf", f"quantize auto: the shipped weight types; {_measured(result)}", twhy)


def _valid_type(result: dict) -> bool:
    """A stored weight-type choice that can be used: its keys, a known type, a positive speed-up,
    a finite drift or none (a corrupt one is measured again, never crashes a start)."""
    speedup, drift = result.get("speedup"), result.get("nll_drift")
    return (
        result.get("quantize") in ("q4_0", "gguf")
        and isinstance(speedup, (int, float))
        and 0 < speedup < math.inf
        and (drift is None or (isinstance(drift, (int, float)) and math.isfinite(drift)))
    )


def _measured(result: dict) -> str:
    """What the type choice measured, in words."""
    speed = f"requantized to Q4_0 it decodes edits at {result['speedup']:.2f}x the shipped file's speed here"
    drift = result["nll_drift"]
    if drift is None:
        return f"{speed} ({taken(result)})"
    return (
        f"{speed}, {drift:+.3f} nats/token on the built-in prompts (tolerance {QUALITY_TOLERANCE:g}; {taken(result)})"
    )
