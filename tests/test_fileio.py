"""Files the user names: atomic writes, modes, folders."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from cactus_cli.core import fileio
from tests.helpers import bench_args, calibrate_args, invoke, pair_args


def test_atomic_write_mode_and_no_parent_creation(tmp_path, tiny):
    path = fileio.atomic_write(tmp_path / "x.txt", "hi")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    with pytest.raises(FileNotFoundError):
        fileio.atomic_write(tmp_path / "new" / "x.txt", "hi")
    assert not (tmp_path / "new").exists()
    r = invoke("chat", *pair_args(tiny), "-n", 2, input=f"/save {tmp_path}/nope/dir/x.json\n/exit\n")
    assert "folder" in r.stderr and "does not exist" in r.stderr
    assert not (tmp_path / "nope").exists()


def _cactus_into_a_pipe(*args: str) -> subprocess.CompletedProcess:
    """cactus with its stdout a pipe, as `cactus ... | column -ts,` runs it."""
    return subprocess.run(
        [sys.executable, "-m", "cactus_cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        timeout=600,
    )


def test_output_flags_write_to_dev_stdout_in_a_pipe(tiny, tmp_path):
    """/dev/stdout in a pipe is a link to /proc/self/fd/1, then to pipe:[N], which is no path:
    every output flag writes through it (it failed with 'cannot write in /proc/<pid>/fd')."""
    r = _cactus_into_a_pipe(*bench_args(tiny), "--csv", "/dev/stdout")
    assert r.returncode == 0, r.stderr
    assert "config,kind,rule" in r.stdout  # the CSV header came through the pipe
    r = _cactus_into_a_pipe(*calibrate_args(tiny), "--save", "/dev/stdout")
    assert r.returncode == 0, r.stderr
    assert "calibration:" in r.stdout  # the profile came through the pipe
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    r = _cactus_into_a_pipe(*bench_args(tiny), "--csv", str(fifo))
    assert r.returncode == 0, r.stderr
    assert "config,kind,rule" in reader.communicate(timeout=60)[0]
    r = _cactus_into_a_pipe(
        "generate", "the cat", *pair_args(tiny), "-n", "4", "--draft", "suffix", "--remember", "/dev/stdout"
    )
    assert r.returncode == 0 and "cactus-suffix-history" in r.stdout, r.stderr
