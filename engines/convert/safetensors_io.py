"""Safetensors files read one tensor at a time and written from a plan, with a checksum taken in-stream.

Reading parses the header and `readinto`s each tensor straight into its torch buffer, in file order.
Writing needs the header first, so the caller plans every (name, dtype, shape) up front (conversions do this
on meta tensors); the writer then streams the data in that order and hashes the file as it goes.
Non-goal: names, layouts, ranks.
"""

from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlstages.engines.convert.ops import RowConcat

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_CHUNK = 1 << 24


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: dtype, shape and byte range within the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_entries(path: Path) -> tuple[int, list[Entry], dict[str, str]]:
    """(data section offset, entries in file order, __metadata__) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a safetensors file (header is not JSON: {e})") from None
    meta = header.pop("__metadata__", None) or {}
    entries = []
    for name, info in header.items():
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, expected one of {sorted(DTYPES)}")
        start, end = info["data_offsets"]
        entries.append(Entry(name, DTYPES[info["dtype"]], tuple(info["shape"]), start, end))
    entries.sort(key=lambda e: e.start)
    return 8 + n, entries, meta


class Reader:
    """Random access to the tensors of one safetensors file (meta, or real tensors backed by a file mapping).

    With `use_mmap` real tensors are zero-copy views of a private (copy-on-write) mapping, released once
    `close()` was called and no tensor refers to it any more; otherwise each tensor is read into its own
    buffer (for callers that copy anyway and must not keep a whole file resident).
    """

    def __init__(self, path: Path, use_mmap: bool = True) -> None:
        self.path = Path(path)
        self.data_start, entries, self.metadata = read_entries(self.path)
        self.entries = {e.name: e for e in entries}
        self.use_mmap = use_mmap
        self._map: mmap.mmap | None = None
        self._buffer: torch.Tensor | None = None
        self._file: io.BufferedReader | None = None

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor with the dtype and shape of `name`."""
        e = self.entries[name]
        return torch.empty(e.shape, dtype=e.dtype, device="meta")

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name`, a view of the file mapping (no copy until written to)."""
        e = self.entries[name]
        if e.start == e.end:
            return torch.empty(e.shape, dtype=e.dtype)
        if not self.use_mmap:
            return self._read(e)
        if self._buffer is None:
            size = self.path.stat().st_size
            if size < self.data_start + max(x.end for x in self.entries.values()):
                raise ValueError(f"{self.path}: truncated file (shorter than its header says)")
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        raw = self._buffer[self.data_start + e.start : self.data_start + e.end]
        if (self.data_start + e.start) % raw.new_empty((), dtype=e.dtype).element_size():
            raw = raw.clone()  # not aligned for its dtype (files from other writers): take a copy
        return raw.view(e.dtype).reshape(e.shape)

    def _read(self, e: Entry) -> torch.Tensor:
        out = torch.empty(e.shape, dtype=e.dtype)
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115  (kept open across calls; closed in close())
        self._file.seek(self.data_start + e.start)
        if self._file.readinto(_bytes(out)) != e.end - e.start:
            raise ValueError(f"{self.path}: truncated file while reading {e.name}")
        return out

    def close(self) -> None:
        """Drop this reader's mapping / file (tensors still in use keep a mapping alive)."""
        self._buffer = None
        self._map = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy stubs: ndarray.__buffer__ on Python >= 3.12 only


@dataclass(frozen=True)
class Planned:
    """One tensor a writer expects: name, dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * torch.empty((), dtype=self.dtype).element_size()


class PlannedWriter:
    """Writes a safetensors file whose tensors are known up front; data streamed in plan order."""

    def __init__(
        self, path: Path, plan: Sequence[Planned], metadata: dict[str, str] | None = None, checksum: str = "crc32"
    ) -> None:
        self.path = Path(path)
        self.checksum = checksum
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        self._offsets: dict[str, tuple[int, int, Planned]] = {}
        pos = 0
        for p in plan:
            if p.name in self._offsets:
                raise ValueError(f"{path}: tensor {p.name} planned twice")
            header[p.name] = {
                "dtype": DTYPE_NAMES[p.dtype],
                "shape": list(p.shape),
                "data_offsets": [pos, pos + p.nbytes],
            }
            self._offsets[p.name] = (pos, pos + p.nbytes, p)
            pos += p.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        head = struct.pack("<Q", len(raw)) + raw
        self.data_start = len(head)
        self.size = self.data_start + pos
        self._written: set[str] = set()
        self._next = 0
        self._hash = new_checksum(checksum)
        self._hash.update(head)
        self._hashing: Future[None] | None = None
        self._in_order = True
        self._file = open(self.path, "wb")  # noqa: SIM115  (closed in close())
        self._file.write(head)

    def write(self, name: str, tensor: torch.Tensor | RowConcat) -> None:
        """Write tensor `name` (must match the planned dtype and shape); row pieces are written in order."""
        if name not in self._offsets:
            raise ValueError(f"{self.path}: tensor {name} was not planned for this file")
        start, end, p = self._offsets[name]
        if tensor.dtype != p.dtype or tuple(tensor.shape) != p.shape:
            raise ValueError(
                f"{self.path}: {name} planned as {p.dtype} {p.shape}, got {tensor.dtype} {tuple(tensor.shape)}"
            )
        if name in self._written:
            raise ValueError(f"{self.path}: tensor {name} written twice")
        self._written.add(name)
        if start == end:
            return
        if start != self._next:
            self._in_order = False
            self._file.seek(self.data_start + start)
        for piece in tensor.pieces if isinstance(tensor, RowConcat) else (tensor,):
            data = _bytes(piece.contiguous())
            self._file.write(data)
            if self._in_order and checksum_enabled(
                self.checksum
            ):  # hash on a helper thread (hashlib drops the GIL) while the next piece is made
                if self._hashing is not None:
                    self._hashing.result()
                self._hashing = _hasher().submit(self._hash.update, data)
        self._next = end

    def close(self, fsync: bool = False) -> str:
        """Finish the file and return its checksum ("" for "none"); every planned tensor must have been written."""
        missing = set(self._offsets) - self._written
        if missing:
            self._file.close()
            raise ValueError(f"{self.path}: {len(missing)} planned tensor(s) never written, e.g. {sorted(missing)[:3]}")
        if self._hashing is not None:
            self._hashing.result()
        if fsync:
            self._file.flush()
            os.fsync(self._file.fileno())
        self._file.close()
        return self._hash.hexdigest() if self._in_order else file_checksum(self.path, self.checksum)

    def abort(self) -> None:
        """Close without checks (the caller removes the temporary directory)."""
        if self._hashing is not None:
            self._hashing.cancel()
        self._file.close()


_HASHER: ThreadPoolExecutor | None = None


def _hasher() -> ThreadPoolExecutor:
    global _HASHER
    if _HASHER is None:
        _HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checksum")
    return _HASHER


CHECKSUMS = ("crc32", "sha256", "none")


class _Crc32:
    """zlib's CRC-32 behind hashlib's update/hexdigest interface (several times faster than sha256)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes | memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


class _NoChecksum:
    def update(self, data: bytes | memoryview) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


def new_checksum(algorithm: str) -> Any:
    """A running checksum: "crc32" (fast corruption check), "sha256" (a content digest, ~3x the CPU) or "none"."""
    if algorithm not in CHECKSUMS:
        raise ValueError(f"checksum must be one of {CHECKSUMS}, got {algorithm!r}")
    factories: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256, "crc32": _Crc32, "none": _NoChecksum}
    return factories[algorithm]()


def checksum_enabled(algorithm: str) -> bool:
    """False for "none"."""
    return algorithm != "none"


def file_checksum(path: Path, algorithm: str = "crc32") -> str:
    """Checksum of a whole file, read in 16 MiB chunks."""
    h = new_checksum(algorithm)
    if checksum_enabled(algorithm):
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return str(h.hexdigest())
