"""The quantized cache file, one tensor at a time: a safetensors file whose metadata holds a
sha256 over every tensor (name, shape, dtype, bytes, in name order).

Reading (``CacheReader``) checks the shapes from the header and the checksum in one streaming
pass, then hands out each tensor when its layer is built, so a start never holds the whole
file in memory besides the layers it builds (nor maps it: plain reads). Writing (``CacheWriter``) lays out the header
first (every tensor's name, dtype and shape are known before quantizing), writes each tensor
where it belongs as it is computed, and fills in the checksum at the end; the file appears
under its name only when whole (a crash leaves no half-written cache).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import tempfile
from pathlib import Path

import torch

DTYPES = {
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.int64: "I64",
}
PLACEHOLDER = "0" * 64  # the checksum's place in the header until it is known


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over every tensor's name, shape, dtype and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        _update(h, name, tensors[name])
    return h.hexdigest()


def _update(h, name: str, t: torch.Tensor) -> None:
    t = t.contiguous()
    h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().data)


class CacheReader:
    """A verified cache: ``name in reader``, ``reader[name]``. Read with plain file reads, not a
    memory map: a mapped file's touched pages count as the process's memory until unmapped, and
    each tensor read is its own copy (a cache replaced while this process runs cannot pull the
    weights from under it)."""

    def __init__(self, path: Path, want: dict[str, tuple[int, ...]]):
        """Raises ValueError naming the problem when a wanted tensor is missing or misshapen,
        the file is not a readable safetensors file, or the checksum does not match."""
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("it is truncated")
            size = struct.unpack("<Q", raw)[0]
            if size > 100_000_000:
                raise ValueError("its header is corrupt")
            header = json.loads(f.read(size))
        self.start = 8 + size
        meta = header.pop("__metadata__", None) or {}
        codes = {v: k for k, v in DTYPES.items()}
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            if not isinstance(e, dict) or e.get("dtype") not in codes:
                raise ValueError(f"{name} has an unknown type")
            begin, end = e["data_offsets"]
            self.entries[name] = (codes[e["dtype"]], tuple(e["shape"]), int(begin), int(end))
        for k, shape in want.items():
            if k not in self.entries:
                raise ValueError(f"{k} is missing")
            if self.entries[k][1] != shape:
                raise ValueError(f"{k} is the wrong shape")
        h = hashlib.sha256()
        for name in sorted(self.entries):
            _update(h, name, self[name])
        if meta.get("sha256") != h.hexdigest():
            raise ValueError("its checksum does not match")

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __getitem__(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        with open(self.path, "rb") as f:
            f.seek(self.start + begin)
            data = bytearray(f.read(end - begin))
        if len(data) != end - begin or len(data) != math.prod(shape) * torch.tensor([], dtype=dtype).element_size():
            raise ValueError(f"{name} is truncated")
        return (
            torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
            if data
            else torch.empty(shape, dtype=dtype)
        )


class CacheWriter:
    """Writes ``specs`` (name -> (dtype, shape)) to ``path``: ``add`` each tensor as it comes,
    then ``finish`` (or ``abort``). Any failure (a full disk, a tensor other than announced, an
    interrupted run) leaves no file and costs only the next start, which quantizes again; only a
    SIGKILL leaves the partial file, which the next quantizing start removes."""

    def __init__(self, path: Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]):
        self.path, self.specs = path, specs
        self.offsets: dict[str, tuple[int, int]] = {}
        pos = 0
        for name in sorted(specs):
            dtype, shape = specs[name]
            size = torch.tensor([], dtype=dtype).element_size() * math.prod(shape)
            self.offsets[name] = (pos, pos + size)
            pos += size
        self.written: set[str] = set()
        self.failed = False
        self.tmp: str | None = None
        self.f = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, self.tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
            self.f = os.fdopen(fd, "w+b")
            self.header = self._header(PLACEHOLDER)
            self.f.write(self.header)
        except OSError:
            self._fail()

    def _header(self, sha: str) -> bytes:
        doc = {
            name: {
                "dtype": DTYPES[self.specs[name][0]],
                "shape": list(self.specs[name][1]),
                "data_offsets": list(self.offsets[name]),
            }
            for name in self.offsets
        }
        doc["__metadata__"] = {"sha256": sha}
        text = json.dumps(doc, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # (safetensors aligns the data to 8 bytes)
        return struct.pack("<Q", len(text)) + text

    def add(self, name: str, t: torch.Tensor) -> None:
        if self.failed:
            return
        t = t.detach().cpu().contiguous()
        spec = self.specs.get(name)
        if spec is None or t.dtype != spec[0] or tuple(t.shape) != tuple(spec[1]) or t.dtype not in DTYPES:
            self._fail()
            return
        try:
            self.f.seek(len(self.header) + self.offsets[name][0])
            self.f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            self.written.add(name)
        except OSError:
            self._fail()

    def finish(self) -> bool:
        """Checksum (read back, one tensor at a time), header, rename. True when cached."""
        if self.failed or self.written != set(self.specs):
            self._fail()
            return False
        try:
            h = hashlib.sha256()
            for name in sorted(self.specs):
                dtype, shape = self.specs[name]
                begin, end = self.offsets[name]
                self.f.seek(len(self.header) + begin)
                data = bytearray(self.f.read(end - begin))
                t = (
                    torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
                    if data
                    else torch.empty(shape, dtype=dtype)
                )
                _update(h, name, t)
            self.f.seek(0)
            self.f.write(self._header(h.hexdigest()))
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            os.replace(self.tmp, self.path)
            self.tmp = None
            return True
        except OSError:
            self._fail()
            return False

    def abort(self) -> None:
        """Give up (an interrupted or failed quantization): the partial file is removed now."""
        self._fail()

    def _fail(self) -> None:
        self.failed = True
        if self.f is not None:
            try:
                self.f.close()
            except OSError:
                pass
        if self.tmp is not None:
            Path(self.tmp).unlink(missing_ok=True)
            self.tmp = None
