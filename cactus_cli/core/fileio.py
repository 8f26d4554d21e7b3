"""Atomic file writes (a temp file beside the target, fsync, then rename, so a killed write never
leaves a half-written file where the old one was), checks that an output path is writable before
a long run starts, and one policy for text that is not valid UTF-8."""

from __future__ import annotations

import errno
import os
import stat
import sys
import tempfile
from pathlib import Path

from cactus_cli.core.errors import ConfigError


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: str | Path, text: str, mode: int | None = None) -> Path:
    """Write ``text`` to ``path`` atomically, with the mode a plain ``open`` would give (the umask's)
    unless ``mode`` says (0o600 for what the user typed). A symlink is written through (its target
    is replaced, the link stays); a character device or FIFO (``/dev/stdout``, a pipe) is written in
    place, as no rename can replace one; a read-only file is refused (PermissionError), never
    replaced. The parent folder must exist: callers create it only where the user asked for it."""
    path = write_target(path)
    if _is_stream(path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    if _read_only(path):
        raise PermissionError(errno.EACCES, "the file is read-only", str(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(
            fd, _umask_mode() if mode is None else mode
        )  # mkstemp makes 0600; a results file should be as readable as any
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_target(path: str | Path) -> Path:
    """The file a write to ``path`` lands on: a symlink's target (the link stays), else the path;
    a device or FIFO reached through links (``/dev/stdout`` in a pipe: /proc/self/fd/1, then
    ``pipe:[N]``, which is no path) is written through the name given."""
    path = Path(path).expanduser()
    if _is_stream(path):
        return path
    return path.resolve() if path.is_symlink() else path


def _read_only(path: Path) -> bool:
    """A regular file with no write bit: the user protected it (root included, whom the kernel
    would let write anyway)."""
    return path.is_file() and not os.stat(path).st_mode & 0o222


def _is_stream(path: Path) -> bool:
    """A character device or FIFO: what is written there is read, not stored under a name."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISCHR(st.st_mode) or stat.S_ISFIFO(st.st_mode)


def check_output_file(path: str | Path, flag: str) -> Path:
    """Fail now, before a long run, if ``path`` cannot be written: a directory, a missing or
    read-only folder, a pseudo-file system. Tries a temp file in the folder, then removes it."""
    path = Path(path).expanduser()
    target = write_target(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file path")
    if _is_stream(target):
        return path  # a device or FIFO: written in place
    if not target.parent.is_dir():
        raise ConfigError(f"{flag} {path}: folder {target.parent} does not exist")
    if _read_only(target):
        raise ConfigError(f"{flag} {path}: the file is read-only; make it writable or give another path")
    _try_write_in(target.parent, f"{flag} {path}")
    return path


def check_output_dir(path: str | Path, flag: str) -> Path:
    """An output folder: created if missing (the user asked for it), and writable."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path}: is a file, not a folder; give a folder to write into")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{flag} {path}: cannot create the folder ({err.strerror or err})") from None
    _try_write_in(path, f"{flag} {path}")
    return path


def _try_write_in(folder: Path, what: str) -> None:
    try:
        fd, tmp = tempfile.mkstemp(prefix=".cactus-write-test-", dir=folder)
        os.close(fd)
        os.unlink(tmp)
    except OSError as err:
        raise ConfigError(f"{what}: cannot write in {folder} ({err.strerror or err})") from None


def write_or_fail(path: str | Path, text: str, what: str) -> Path:
    """atomic_write with any OSError turned into one line naming the file (exit 2)."""
    try:
        return atomic_write(path, text)
    except OSError as err:
        raise ConfigError(f"{what}: could not write {path} ({err.strerror or err})") from None


# --------------------------------------------------------------------------- text that is not UTF-8
# One policy: text a user types or pipes in (a prompt argument, stdin, a chat line) has undecodable
# bytes replaced with U+FFFD and one warning; a file the tool parses (a profile, a prompts file) is
# an error naming the file and line, because a replaced byte there would silently change a setting.

_warned = False


def _warn_replaced(where: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"warning: {where} is not valid UTF-8; undecodable bytes were replaced with U+FFFD", file=sys.stderr)


def clean_text(text: str, where: str) -> str:
    """A str from the command line may hold undecodable bytes as surrogates (Python's
    surrogateescape): replace them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        _warn_replaced(where)
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def decode_input(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        _warn_replaced(where)
        return data.decode("utf-8", "replace")


def read_utf8_file(path: Path, what: str) -> str:
    """A file's text, or an error naming the file, line and column of the first bad byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        col = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
        raise ConfigError(
            f"{path}:{line}:{col}: {what} is not valid UTF-8 (byte 0x{data[err.start]:02x}); save it as UTF-8"
        ) from None
