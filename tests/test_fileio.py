"""Files the user names: atomic writes, modes, folders."""

from __future__ import annotations

import os
import stat

import pytest

from cactus_cli.core import fileio
from tests.helpers import invoke, pair_args


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
