"""Tensor parallelism (`--tp N`) on a CPU: 2 processes over gloo in float32, the tiny Llama
verifier (4 attention heads, 2 key/value heads). Real processes, real process group: greedy
output equals --tp 1 token for token, a seeded sampled run gives the same text, bad N is one
line, and a rank that dies ends the others within seconds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import pytest
import torch

from cactus_cli.core.errors import ConfigError
from cactus_cli.infer.backends.torch.group import check_tp
from tests.helpers import (
    cactus_run,
    ctrl_c_as_in_a_terminal,
    decoding,
    invoke,
    listening_addresses,
    one_line_error,
    tiny_args,
    wait_for,
)


def pair(tiny) -> list[str]:
    """The tiny pair, on the CPU, eager (after a command's own flags, so its --dtype stands)."""
    return ["--verifier", tiny["verifier"], "--draft", tiny["draft_close"], "--device", "cpu", "--compile", "off"]


def cactus(tiny, *args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cactus_cli", *args, *pair(tiny)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        **kwargs,
    )


def text(tiny, tp, *args) -> str:
    """The generated text; --tp 1 in this process (a subprocess is 6 s of imports), a group in its own."""
    argv = ("generate", "the cat sat on the mat and then", "--tp", str(tp), "-n", "24", "--json", "--dtype", "float32")
    if tp == 1:
        r = invoke(*argv, *args, *pair(tiny))
        assert r.exit_code == 0, r.output[-2000:]
    else:
        r = cactus(tiny, *argv, *args)
        assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert doc["settings"]["dtype_resolved"] == "float32"
    return doc["text"]


@pytest.mark.parametrize("k", ["4"])  # (k = 4 verifies blocks of 1 to 5 rows: k = 1's widths too)
def test_tp2_greedy_equals_tp1(tiny, k):
    one = text(tiny, 1, "-t", "0", "-k", k)
    assert one.strip()
    assert text(tiny, 2, "-t", "0", "-k", k) == one


def test_tp2_seeded_sampling_gives_the_same_text(tiny):
    args = ("-t", "0.9", "--seed", "7", "-k", "4")  # a fixed k: -k auto follows each run's timings
    assert text(tiny, 2, *args) == text(tiny, 1, *args)


def test_bad_n_is_one_line(tiny):
    """Refused before any rank starts (in-process: a subprocess per case was 6 s of imports each)."""
    r = invoke("generate", "hi", "--tp", "3", *pair(tiny))
    assert r.exit_code == 2 and r.output.strip() == (
        "error: --tp 3: the verifier has 4 attention heads and 2 key/value heads; N must divide both (e.g. --tp 2)"
    ), r.output
    one_line_error(invoke("generate", "hi", "--tp", "2", "--dtype", "bfloat16", *pair(tiny)), "gloo in float32")
    r = invoke("bench", "--tp", "2", "--compare-hf", *pair(tiny))
    one_line_error(r, "--compare-hf")
    assert "--tp" in r.output.strip().splitlines()[-1]


def test_check_tp_names_the_problem(monkeypatch):
    no_plan = types.SimpleNamespace(
        architectures=["ToyForCausalLM"], base_model_tp_plan=None, num_attention_heads=8, num_key_value_heads=8
    )
    with pytest.raises(ConfigError, match="no tensor-parallel plan for ToyForCausalLM"):
        check_tp(2, no_plan, torch.device("cpu"), "toy")
    ok = types.SimpleNamespace(
        base_model_tp_plan={"layers.*.self_attn.q_proj": "colwise"}, num_attention_heads=8, num_key_value_heads=8
    )
    check_tp(8, ok, torch.device("cpu"), "toy")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"--tp 2: only 1 GPU visible; use --tp 1 or fewer"):
        check_tp(2, ok, torch.device("cuda"), "toy")


def _start_long_run(tiny):
    # a bench over every built-in prompt: minutes of decoding (one generate fills the tiny context in seconds)
    cmd = [
        sys.executable,
        "-m",
        "cactus_cli",
        "bench",
        "--verifier",
        tiny["verifier"],
        "--draft",
        tiny["draft_close"],
        "--device",
        "cpu",
        "--compile",
        "off",
        "--tp",
        "2",
        "--rules",
        "sps",
        "-k",
        "4",
        "-n",
        "400",
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        preexec_fn=ctrl_c_as_in_a_terminal,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until the follower is up and the run is decoding
        children = _children(proc.pid)
        if children and time.monotonic() > deadline - 110:
            time.sleep(3)
            return proc, children[0]
        time.sleep(0.5)
    proc.kill()
    pytest.fail("the tensor-parallel run did not start")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
    except OSError:
        return False


def test_a_killed_follower_ends_the_run_within_seconds(tiny):
    proc, follower = _start_long_run(tiny)
    os.kill(follower, signal.SIGKILL)
    t0 = time.monotonic()
    try:
        proc.wait(timeout=20)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 1
    assert proc.stderr.read().strip().splitlines()[-1] == (
        "error: tensor-parallel rank 1 exited with code -9; stopping every rank"
    )


def test_a_killed_rank0_ends_the_follower_and_ctrl_c_stops_every_rank(tiny):
    proc, follower = _start_long_run(tiny)
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    while _alive(follower) and time.monotonic() - t0 < 20:
        time.sleep(0.2)
    assert not _alive(follower) and time.monotonic() - t0 < 10
    proc, follower = _start_long_run(tiny)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=20) == 130
    t0 = time.monotonic()
    while _alive(follower) and time.monotonic() - t0 < 20:
        time.sleep(0.2)
    assert not _alive(follower)


def test_under_torchrun(tiny):
    # every rank runs the command; ranks > 0 turn into followers and print nothing
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "cactus_cli",
        "generate",
        "the cat sat on the mat and then",
        "--verifier",
        tiny["verifier"],
        "--draft",
        tiny["draft_close"],
        "--device",
        "cpu",
        "--compile",
        "off",
        "--dtype",
        "float32",
        "--tp",
        "2",
        "-n",
        "24",
        "-t",
        "0",
        "-k",
        "4",
        "--plain",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == text(tiny, 1, "-t", "0", "-k", "4").strip()


def test_a_follower_whose_rank0_pipe_ends_cleans_up_at_once_whatever_its_main_thread_does(tmp_path):
    """The follower learns that rank 0 is gone from the end of the pipe rank 0 holds on its stdin,
    not from its parent's pid: a killed rank 0's sockets close before the kernel reparents its
    children, so a check of the parent right after the failed collective still saw rank 0 and the
    follower exited leaving its log and the rendezvous folder behind (3 of 11 runs under load)."""
    from cactus_cli.infer.backends.torch import group

    store = tmp_path / "cactus-tp-x" / "store"
    store.parent.mkdir()
    store.write_text("")
    log = tmp_path / "cactus-tp-rank1-x.log"
    log.write_text("")
    busy = (
        "import threading, time\n"
        "from cactus_cli.app import follower\n"
        "threading.Thread(target=follower._watch_rank0, daemon=True).start()\n"
        "print('ready', flush=True)\n"
        "sum(i * i for i in range(10**10))\n"
    )  # the main thread busy in Python, holding the GIL often
    env = dict(os.environ, **{group.LOG_ENV: str(log), group.STORE_ENV: str(store)})
    proc = subprocess.Popen([sys.executable, "-c", busy], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(0.5)
        assert log.exists() and store.exists()  # nothing happens while rank 0 lives
        proc.stdin.close()  # what the kernel does when rank 0 dies, however it dies
        t0 = time.monotonic()
        assert proc.wait(timeout=10) == 3
        assert time.monotonic() - t0 < 2
    finally:
        proc.kill()
    assert not log.exists() and not store.parent.exists()


def test_a_group_environment_without_a_peer(tiny, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")  # (refused before a group starts: in-process)
    one_line_error(invoke("generate", "hi", "--tp", "2", "-n", "4", *tiny_args(tiny)), "WORLD_SIZE=2 and RANK=0")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    r = cactus_run(
        ["generate", "hi", "--tp", "2", "-n", "4", *tiny_args(tiny)],
        env={
            "WORLD_SIZE": "2",
            "RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "CACTUS_TP_RENDEZVOUS_SECONDS": "3",
        },
    )
    assert time.monotonic() - t0 < 60  # waited for 7 days before
    assert r.returncode == 2, r.stderr
    assert "waiting up to 3 s for 2 tensor-parallel ranks" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: tensor parallel: not all 2 ranks joined within 3 s")


def test_tp_listens_on_loopback_only_and_leaves_nothing_behind(tiny, tmp_path, isolated_home):
    pytest.importorskip("psutil")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TMPDIR=str(tmp_path))
    cmd = [
        sys.executable,
        "-m",
        "cactus_cli",
        "bench",
        *tiny_args(tiny),
        "--dtype",
        "float32",
        "--tp",
        "2",
        "--rules",
        "sps",
        "-k",
        "4",
        "-n",
        "400",
    ]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        shutil.rmtree(isolated_home / "costs", ignore_errors=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert wait_for(decoding(isolated_home), 240), "the group never started decoding"
            listening = listening_addresses(proc.pid)
            assert listening and all(ip in ("127.0.0.1", "::1") for ip in listening), listening
            proc.send_signal(sig)
            proc.wait(timeout=60)
        finally:
            proc.kill()
        # rank 0 cleans up after SIGTERM; after SIGKILL the follower removes its own log
        assert wait_for(lambda: not list(tmp_path.glob("cactus-tp-*")), 5), list(tmp_path.iterdir())
        if sig == signal.SIGTERM:
            assert proc.returncode == 130
