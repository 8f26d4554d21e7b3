"""Files the user names: atomic writes, modes, folders."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading

import pytest

from cactus_cli.core import fileio
from cactus_cli.core.errors import ConfigError
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


def test_a_symlink_is_written_through_to_its_target(tmp_path):
    target = tmp_path / "results.csv"
    target.write_text("old\n")
    link = tmp_path / "link.csv"
    link.symlink_to(target)
    fileio.check_output_file(link, "--csv")
    fileio.atomic_write(link, "new\n")
    assert link.is_symlink() and link.resolve() == target.resolve()
    assert target.read_text() == "new\n"


def test_a_read_only_file_is_refused_before_the_run_and_never_replaced(tmp_path):
    kept = tmp_path / "kept.yaml"
    kept.write_text("mine\n")
    kept.chmod(0o444)
    with pytest.raises(ConfigError, match="read-only"):
        fileio.check_output_file(kept, "--save")
    with pytest.raises(PermissionError):
        fileio.atomic_write(kept, "theirs\n")  # (as root too: the kernel would let root write)
    assert kept.read_text() == "mine\n" and stat.S_IMODE(kept.stat().st_mode) == 0o444


def test_a_fifo_is_written_in_place_not_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, encoding="utf-8").read()))
    reader.start()
    fileio.check_output_file(fifo, "--csv")
    fileio.atomic_write(fifo, "a,b\n1,2\n")
    reader.join(timeout=10)
    assert got == ["a,b\n1,2\n"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["pipe"]  # no temp file left beside it
