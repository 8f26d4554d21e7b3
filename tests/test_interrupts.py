"""Ctrl-C at random points of every command leaves nothing under TMPDIR or CACTUS_HOME but
finished caches."""

from __future__ import annotations

import os

import pytest

from tests.helpers import ctrl_c_as_in_a_terminal

LEFTOVER = (".tmp", ".tmp-", "chat_history", "cactus-check-", "cactus-tp-", ".cactus-write-test-")


def _leftovers(*folders):
    """Files or folders a finished cache never is: temp names, partial writes, typed history."""
    found = []
    for folder in folders:
        for p in folder.rglob("*") if folder.is_dir() else ():
            if any(mark in p.name for mark in LEFTOVER) or (folder.name == "tmp" and p.parent == folder):
                found.append(str(p.relative_to(folder)))
    return found


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "the cat sat", "--quantize", "int8", "-n", "40", "--plain"],
        ["chat", "--draft", "suffix", "-n", "30"],
        ["bench", "--rules", "sps,cactus", "-k", "2,auto", "-n", "12", "--limit", "4", "--csv", "OUT/b.csv"],
        ["eval", "--tasks", "TASKS", "--rules", "sps", "-k", "2", "-n", "16", "--out", "OUT/e"],
        ["calibrate", "--limit", "2", "-n", "8", "--delta", "0.5", "-k", "1,2", "--save", "OUT/p.yaml"],
    ],
    ids=["generate", "chat", "bench", "eval", "calibrate"],
)
def test_ctrl_c_at_random_points_leaves_nothing_but_finished_caches(tiny, tmp_path, command):
    import json
    import random
    import signal
    import subprocess
    import sys
    import time

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(
        json.dumps({"prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"}) + "\n"
    )
    (tmp_path / "out").mkdir()
    args = [a.replace("TASKS", str(tasks)).replace("OUT", str(tmp_path / "out")) for a in command]
    model = ["--verifier", tiny["verifier"], "--device", "cpu", "--dtype", "float32"]
    if "--draft" not in args:
        model += ["--draft", tiny["draft_close"]]
    rng = random.Random(" ".join(command))
    for attempt in range(2 if command[0] == "generate" else 1):  # (each attempt costs ~6 s of the suite)
        home, tmp = tmp_path / f"home{attempt}", tmp_path / f"t{attempt}" / "tmp"
        tmp.mkdir(parents=True)
        env = dict(os.environ, CACTUS_HOME=str(home), TMPDIR=str(tmp), HF_HUB_OFFLINE="1")
        proc = subprocess.Popen(
            [sys.executable, "-m", "cactus_cli", *args, *model],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            text=True,
            preexec_fn=ctrl_c_as_in_a_terminal,
        )
        if command[0] == "chat":
            proc.stdin.write("the cat sat on the mat\n" * 20)
            proc.stdin.flush()
        time.sleep(rng.uniform(1.5, 9.0))  # (imports take ~3 s: some land in loading, some in decoding)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert "Traceback" not in err, err
        assert _leftovers(home, tmp) == [], (attempt, err)


def test_a_ctrl_c_inside_a_finalizer_is_raised_just_after_without_a_traceback():
    """Python cannot raise a KeyboardInterrupt from a ``__del__`` (it prints "Exception ignored ...
    Traceback" and goes on); the CLI's hook raises it again just after, quietly."""
    import subprocess
    import sys

    script = (
        "import time\n"
        "from cactus_cli.core.signals import treat_sigterm_as_sigint\n"
        "treat_sigterm_as_sigint()\n"
        "class Finalized:\n"
        "    def __del__(self):\n"
        "        raise KeyboardInterrupt\n"
        "try:\n"
        "    Finalized()\n"
        "    time.sleep(5)\n"
        "    print('went on')\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted')\n"
    )
    import signal

    for sigint in (signal.SIG_DFL, signal.SIG_IGN):  # (SIG_IGN: a background job, as CI's may be)
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=lambda s=sigint: signal.signal(signal.SIGINT, s),
        )
        assert out.stdout.strip() == "interrupted" and "Traceback" not in out.stderr, (sigint, out.stderr)
