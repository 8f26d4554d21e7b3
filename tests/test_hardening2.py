"""The second hardening sweep (issue 20's sibling, issue 23): each numbered cause of the sweep
reproduced and now clean. Real subprocesses where the behaviour is about exits, signals or
leftovers; the numbers in the test names are the sweep's."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from typer.testing import CliRunner

from cactus_cli.app import tasks
from cactus_cli.app.settings import check_flags_apply, flags_to_settings, parse_params
from cactus_cli.cli.main import app
from cactus_cli.core.errors import ConfigError
from cactus_cli.core.paths import cache_path
from cactus_cli.infer import costs as policy
from cactus_cli.infer import quantize
from cactus_cli.infer.policy import AdaptiveK

runner = CliRunner()


def cli(*args, **kwargs):
    return runner.invoke(app, [str(a) for a in args], **kwargs)


def one_line_error(r, needle: str, code: int = 2) -> None:
    assert r.exit_code == code, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error: ") and needle in lines[-1], r.output
    assert "Traceback" not in r.output


def tiny_args(tiny, draft="draft_close"):
    return ["--verifier", tiny["verifier"], "--draft", tiny[draft], "--device", "cpu", "--compile", "off",
            "--dtype", "float32", "--quantize", "none"]


# --------------------------------------------------------------------------- tracebacks


def test_01_lm_eval_model_args_without_draft():
    out = flags_to_settings(rule="cactus", delta=1.0)  # KeyError: 'draft' before
    assert out["rule"] == "cactus" and "draft" not in out


@pytest.mark.parametrize("pattern,text,want", [
    (r"answer:\s*(\d+)?", "answer: none", None),
    (r"(\d+)|\S", "x 5 y", "5"),
    (r"(\d+)|\S", "x y", None),
])
def test_02_a_pattern_group_that_takes_no_part_is_no_answer(pattern, text, want):
    assert tasks.extract_answer(text, pattern) == want


def _quantize_tiny(tiny, **kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.bfloat16)
    return model, quantize.quantize_model(model, "int8", tiny["verifier"], **kwargs)


def test_03_a_full_disk_does_not_stop_the_run(tiny, monkeypatch):
    from cactus_cli.infer import qcache

    real = os.fdopen

    class Full:  # the cache file's writes fail the way a full disk fails them
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(28, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

    path = quantize.cache_file(quantize.weights_key(tiny["verifier"]), "int8")
    path.unlink(missing_ok=True)  # (an earlier test may have cached it)
    with monkeypatch.context() as m:
        m.setattr(qcache.os, "fdopen", lambda *a, **k: Full(real(*a, **k)))
        _, text = _quantize_tiny(tiny)  # raised SafetensorError before
    assert text.startswith("int8 weights")
    assert not list(path.parent.glob(".*.tmp")) and not path.exists()
    _quantize_tiny(tiny)  # (the next start quantizes again and caches)
    assert path.exists()


def _write_costs(path: Path, costs: dict, acceptance: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"schema": policy.SCHEMA, "key": {}, "costs": costs, "acceptance": acceptance}))


@pytest.mark.parametrize("costs,acceptance", [
    ({"verify": {"1": [0.1]}}, {"greedy": [[-5.0], [-5.0]]}),  # a negative count: ZeroDivisionError before
    ({"verify": {"1": [0.1]}}, {"greedy": [[float("nan")], [1.0]]}),  # NaN: k = 0 forever, written back
    ({"verify": {"-3": [0.1], "0": [0.1], "1000000": [0.1], "1": [0.1]}}, {}),  # impossible widths
    ({"verify": {"1": [1e308, 0.1], "2": [-1, 0.2]}, "draft": {"model": [float("nan"), 0.01]}}, {}),
])
def test_04_15_invalid_cost_entries_are_dropped_said_and_never_written_back(tmp_path, costs, acceptance):
    path = tmp_path / "costs.json"
    _write_costs(path, costs, acceptance)
    p = policy.CostStore(path)
    assert len(p.notes) == 1 and "invalid" in p.notes[0]
    assert all(1 <= w <= policy.MAX_WIDTH for w in p.costs.verify)
    assert all(math.isfinite(p.costs.t_v(w)) and 0 < p.costs.t_v(w) < 1 for w in range(1, 10))
    for acc in p.acceptance.values():
        assert all(math.isfinite(r) for r in acc.rates(8))
    assert AdaptiveK(p).choose("greedy", 4) in range(5)
    p.save()
    again = policy.CostStore(path)
    assert again.notes == []  # what was written back is clean


def test_04_deeply_nested_or_garbage_cost_cache(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text("[" * 100000 + "]" * 100000)  # RecursionError before
    p = policy.CostStore(path)
    assert p.notes and "unreadable" in p.notes[0]


@pytest.mark.parametrize("seconds", [{"float32": 0, "bfloat16": 0}, {"float32": -0.2, "bfloat16": 0.1},
                                     {"float32": float("nan"), "bfloat16": 0.1}])
def test_04_15_a_corrupt_dtype_cache_is_measured_again(monkeypatch, seconds):
    from cactus_cli.infer import devices as models

    key = {"cpu": models.device_name(torch.device("cpu")), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "shape": [64, 128]}
    path = cache_path(key, "dtype-")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "seconds": seconds}))
    dtype, why = models.fastest_cpu_dtype(64, 128)  # ZeroDivisionError / "-0.20x faster" before
    assert "(cached)" not in why and "nan" not in why and "-" not in why.split("x faster")[0]
    assert all(v > 0 for v in json.loads(path.read_text())["seconds"].values())


def test_05_13_a_damaged_quantized_cache_is_rebuilt_with_one_line(tiny):
    from safetensors.torch import load_file, save_file

    model, _ = _quantize_tiny(tiny)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    path = quantize.cache_file(quantize.weights_key(tiny["verifier"]), "int8")
    good = load_file(str(path))
    damages = {
        "missing": lambda t: {k: v for k, v in t.items() if k != "lm_head.scales"},
        "flipped": lambda t: {**t, "model.layers.0.mlp.up_proj.q": t["model.layers.0.mlp.up_proj.q"] ^ 1},
        "cut head": lambda t: {**t, "lm_head.q": t["lm_head.q"][:10]},
    }
    for what, damage in damages.items():
        # written with the good file's checksum: what a flipped byte on disk looks like
        save_file(damage(good), str(path), metadata={"sha256": quantize.checksum(good)})
        lines = []
        model2, _ = _quantize_tiny(tiny, report=lines.append)
        assert any("damaged" in ln for ln in lines), what
        state = model2.state_dict()
        assert all(torch.equal(state[k], reference[k]) for k in reference), what
        assert quantize.checksum(load_file(str(path))) == quantize.checksum(good)  # the file was replaced


def test_06_lm_eval_stats_file_in_a_missing_folder_fails_at_creation(tiny, tmp_path):
    pytest.importorskip("lm_eval")
    from cactus_cli.app.lm_eval_adapter import CactusLM

    with pytest.raises(ConfigError, match="folder .* does not exist"):
        CactusLM(verifier=tiny["verifier"], draft=tiny["draft"], device="cpu", compile="off", quantize="none",
                 dtype="float32", stats_file=str(tmp_path / "no" / "stats.jsonl"))


def test_07_lm_eval_continuation_longer_than_the_context(tiny):
    pytest.importorskip("lm_eval")
    from cactus_cli.app.lm_eval_adapter import CactusLM
    from cactus_cli.core.errors import ContextLimitError

    lm = CactusLM(verifier=tiny["short_context"], draft="none", device="cpu", compile="off", quantize="none",
                  dtype="float32")
    with pytest.raises(ContextLimitError, match="does not fit the verifier's context window of 16"):
        lm._score([5, 6], list(range(5, 30)))  # size mismatch RuntimeError before
    assert math.isfinite(lm._score([5, 6], [7, 8])[0])


def _cactus(args, env=None, timeout=120, **kw):
    return subprocess.run([sys.executable, "-m", "cactus_cli", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, HF_HUB_OFFLINE="1", **(env or {})), **kw)


def test_08_10_a_group_environment_without_a_peer(tiny):
    r = _cactus(["generate", "hi", "--tp", "2", "-n", "4", *tiny_args(tiny)], env={"WORLD_SIZE": "2", "RANK": "0"})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: WORLD_SIZE=2 and RANK=0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    r = _cactus(["generate", "hi", "--tp", "2", "-n", "4", *tiny_args(tiny)],
                env={"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     "CACTUS_TP_RENDEZVOUS_SECONDS": "3"})
    assert time.monotonic() - t0 < 60  # waited for 7 days before
    assert r.returncode == 2, r.stderr
    assert "waiting up to 3 s for 2 tensor-parallel ranks" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: tensor parallel: not all 2 ranks joined within 3 s")


@pytest.mark.parametrize("value", ["[unclosed", "!!python/object/apply:os.system ['true']", "*alias"])
def test_09_param_yaml_errors_are_one_line(value):
    with pytest.raises(ConfigError, match="--param epsilon"):
        parse_params([f"epsilon={value}"])


def test_11_a_backtracking_pattern_gives_up_and_ctrl_c_still_works():
    t0 = time.monotonic()
    assert tasks.extract_answer("x" * 40, r"((x|xx)+)+y(\d)") == tasks.PATTERN_TIMED_OUT
    assert time.monotonic() - t0 < tasks.PATTERN_SECONDS + 3
    # Ctrl-C as in a terminal: a suite started in the background (`pytest &`, nohup) hands its
    # children SIGINT ignored, and Python then never raises KeyboardInterrupt (what made this flaky)
    code = ("import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from cactus_cli.app.tasks import extract_answer\nimport sys\nprint('ready', flush=True)\n"
            "while True: extract_answer('x' * 40, r'((x|xx)+)+y(\\d)')")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)  # within one give-up (2 s) on a quiet machine; slack for a loaded one
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in proc.stderr.read()


ALIAS_BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"] + [
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]" for i in range(8)])


def test_12_a_yaml_alias_bomb_is_refused_at_once(isolated_home):
    folder = isolated_home / "profiles"
    folder.mkdir(parents=True)
    (folder / "bomb.yaml").write_text("verifier: x\ncalibration:\n  " + ALIAS_BOMB.replace("\n", "\n  ") + "\n")
    t0 = time.monotonic()
    r = cli("profiles", "show", "bomb")
    assert time.monotonic() - t0 < 10
    one_line_error(r, "YAML aliases")


# --------------------------------------------------------------------------- silently wrong


def test_14_int4_says_what_ran(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.bfloat16)
    lines = []
    text = quantize.quantize_model(model, "int4", tiny["verifier"], report=lines.append)
    assert "in int8" in text and text in lines  # said once, and kept for --json


def test_16_settings_that_do_nothing_are_errors(tiny, tmp_path):
    base = tiny_args(tiny)
    one_line_error(cli("bench", *base, "-k", "2", "--max-draft-tokens", "50"), "--max-draft-tokens only applies")
    one_line_error(cli("eval", *base, "--rules", "sps", "--delta", "0.5"), "--delta has no effect")
    none = [a for a in tiny_args(tiny) if a != tiny["draft_close"] and a != "--draft"]
    one_line_error(cli("generate", "hi", *none, "--draft", "none", "--max-draft-tokens", "5"),
                   "--max-draft-tokens has no effect without a draft")
    settings = flags_to_settings(rule="sps", delta=0.5, ngram_max=2, verifier=tiny["verifier"], draft=tiny["draft"])
    from cactus_cli.app.profiles import resolve_settings

    with pytest.raises(ConfigError, match="--delta has no effect"):
        check_flags_apply(resolve_settings(None, settings), settings)
    for body, needle in (("draft: some/model\nngram_max: 3\n", "ngram_max applies only to prompt lookup"),
                         ("num_draft_tokens: 4\nmax_draft_tokens: 3\n", "max_draft_tokens applies only with")):
        path = tmp_path / "p.yaml"
        path.write_text(f"verifier: {tiny['verifier']}\n" + body)
        one_line_error(cli("profiles", "show", path), needle)


@pytest.mark.parametrize("answer,needle", [(float("nan"), "not a finite number"), (1e400, "not a finite number"),
                                           ("  ", "is empty"), ("inf", "not a finite number")])
def test_16_task_answers_that_can_never_match(tmp_path, answer, needle):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "q", "answer": answer}) + "\n")
    with pytest.raises(ConfigError, match=needle):
        tasks.load_tasks(str(path), None)


def test_16_chat_set_max_draft_tokens_with_a_fixed_k(tiny):
    from tests.test_chat import chat

    r = chat(tiny, "/set max_draft_tokens=5\n", "-k", "2")
    assert "applies only with -k auto" in r.output


def test_16_models_quality_cuts_texts_longer_than_the_context(tiny, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": " ".join(["the cat sat on the mat"] * 10)}) + "\n")
    r = cli("models", "quality", "--verifier", tiny["short_context"], "--device", "cpu", "--quantize", "int8",
            "--prompts", prompts, "--json")
    assert r.exit_code == 0, r.output
    assert "scored on their first 16 tokens" in " ".join(r.output.split())


# --------------------------------------------------------------------------- signals and leftovers


def _wait_for(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _decoding(home: Path) -> Callable[[], bool]:
    """True once a run has finished a generation (its step costs are saved after each one)."""
    return lambda: any((home / "costs").glob("*.json")) if (home / "costs").is_dir() else False


def test_17_sigterm_keeps_finished_rows(tiny, tmp_path, isolated_home):
    out, csv = tmp_path / "o", tmp_path / "rows.csv"
    proc = subprocess.Popen([sys.executable, "-m", "cactus_cli", "bench", *tiny_args(tiny), "--rules", "sps",
                             "-k", "4", "-n", "400", "--out", str(out), "--csv", str(csv)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        assert _wait_for(_decoding(isolated_home), 240), "the bench never started decoding"
        time.sleep(8)  # past the warm-up: the first prompts of 8 x 400 tokens are done
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert (out / "bench.json").is_file() and csv.is_file()
    doc = json.loads((out / "bench.json").read_text())
    assert doc["interrupted"] is True and doc["results"], stdout


def test_19_stale_temp_files_of_dead_writers_are_removed(tiny):
    folder = quantize.cache_file(quantize.weights_key(tiny["verifier"]), "int8").parent
    folder.mkdir(parents=True, exist_ok=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = folder / f".int8-abc.safetensors.{dead}.x1y2.tmp"
    live = folder / f".int8-abc.safetensors.{os.getpid()}.x1y2.tmp"
    stale.write_bytes(b"0" * 1000)
    live.write_bytes(b"0" * 1000)
    _quantize_tiny(tiny)
    assert not stale.exists() and live.exists()  # a live writer's file is its own business
    live.unlink()


def _listening(pid: int) -> list[str]:
    import psutil

    out = []
    for proc in [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True):
        for c in proc.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                out.append(c.laddr.ip)
    return out


def test_18_20_tp_listens_on_loopback_only_and_leaves_nothing_behind(tiny, tmp_path, isolated_home):
    pytest.importorskip("psutil")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path))
    cmd = [sys.executable, "-m", "cactus_cli", "bench", *tiny_args(tiny), "--dtype", "float32", "--tp", "2",
           "--rules", "sps", "-k", "4", "-n", "400"]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        shutil.rmtree(isolated_home / "costs", ignore_errors=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert _wait_for(_decoding(isolated_home), 240), "the group never started decoding"
            listening = _listening(proc.pid)
            assert listening and all(ip in ("127.0.0.1", "::1") for ip in listening), listening
            proc.send_signal(sig)
            proc.wait(timeout=60)
        finally:
            proc.kill()
        # rank 0 cleans up after SIGTERM; after SIGKILL the follower removes its own log
        assert _wait_for(lambda: not list(tmp_path.glob("cactus-tp-*")), 5), list(tmp_path.iterdir())
        if sig == signal.SIGTERM:
            assert proc.returncode == 130


def test_the_quantized_cache_streams_tensor_by_tensor_in_the_safetensors_format(tmp_path):
    from safetensors.torch import load_file, save_file

    from cactus_cli.infer.qcache import CacheReader, CacheWriter, checksum

    tensors = {"a.q": torch.randint(-127, 127, (5, 8), dtype=torch.int8), "a.scales": torch.rand(5),
               "b.q": torch.randint(0, 255, (3, 4), dtype=torch.uint8), "s": torch.rand(8)}
    specs = {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}
    path = tmp_path / "int8-x-y.safetensors"
    w = CacheWriter(path, specs)
    for k in ("s", "b.q", "a.q", "a.scales"):  # in the order they are computed, not the file's
        w.add(k, tensors[k])
    assert w.finish()
    loaded = load_file(str(path))  # what safetensors itself reads
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    r = CacheReader(path, {k: s for k, (_, s) in specs.items()})
    assert all(torch.equal(r[k], v) for k, v in tensors.items()) and "a.q" in r and "zz" not in r
    old = tmp_path / "old.safetensors"  # a cache written by earlier versions (safetensors' save_file)
    save_file(tensors, str(old), metadata={"sha256": checksum(tensors)})
    assert torch.equal(CacheReader(old, {"a.q": (5, 8)})["a.q"], tensors["a.q"])
    with pytest.raises(ValueError, match="wrong shape"):
        CacheReader(path, {"a.q": (8, 5)})
    with pytest.raises(ValueError, match="missing"):
        CacheReader(path, {"c.q": (1,)})
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        CacheReader(path, {})
    path.write_bytes(bytes(data[:20]))
    with pytest.raises(ValueError):
        CacheReader(path, {})
    bad = tmp_path / "int8-x-z.safetensors"
    w = CacheWriter(bad, specs)
    w.add("a.q", tensors["a.q"].float())  # not what was announced: nothing is cached
    for k in ("s", "b.q", "a.scales"):
        w.add(k, tensors[k])
    assert not w.finish() and not bad.exists() and not list(tmp_path.glob(".*.tmp"))
