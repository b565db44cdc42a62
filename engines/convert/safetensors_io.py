"""Safetensors files read one tensor at a time and written from a plan, with a checksum taken in-stream.

Reading parses the header and `readinto`s each tensor straight into its torch buffer, in file order.
Writing needs the header first, so the caller plans every (name, dtype, shape) up front (conversions do this
on meta tensors); the writer then streams the data in that order, in cache-sized chunks, and hashes each
chunk just before writing it, so the write copies from the CPU cache (one pass over memory, one thread).
A strided tensor (a row-parallel TP shard) goes through one reused staging buffer, block of rows by block.
The default checksum is XXH3-128 (xxhash, 128 bits; 6.0 vs CRC-32's 4.0 GB/s here); CRC-32 and SHA-256 remain.
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
WRITE_CHUNK = 1 << 18  # bytes hashed then written at a time: the write copies them out of L2; few syscalls
DEFAULT_CHECKSUM = "xxh3_128"
CHECKSUMS = ("xxh3_128", "crc32", "sha256", "none")


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
        self,
        path: Path,
        plan: Sequence[Planned],
        metadata: dict[str, str] | None = None,
        checksum: str = DEFAULT_CHECKSUM,
        *,
        chunk_bytes: int = WRITE_CHUNK,
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
        self._hashing = checksum_enabled(checksum)  # until a write lands out of plan order (then: re-read)
        self._chunk = max(1, chunk_bytes)
        self._staging: torch.Tensor | None = None
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
            self._hashing = False  # the in-stream checksum needs file order; close() re-reads the file instead
            self._file.seek(self.data_start + start)
        for piece in tensor.pieces if isinstance(tensor, RowConcat) else (tensor,):
            if piece.numel() == 0:
                continue
            if piece.is_contiguous():
                self._put(_bytes(piece))
            else:
                self._put_strided(piece)
        self._next = end

    def _put(self, data: memoryview) -> None:
        """Write `data` chunk by chunk, each hashed just before its write: the hash brings the chunk into the
        cache (and maps its source pages, so the kernel's copy does not fall back to zero-fill-and-retry)."""
        step = self._chunk
        for i in range(0, len(data), step):
            chunk = data[i : i + step]
            if self._hashing:
                self._hash.update(chunk)
            self._file.write(chunk)

    def _put_strided(self, piece: torch.Tensor) -> None:
        """A non-contiguous tensor, gathered block of dim-0 rows by block into one reused staging buffer."""
        row_bytes = piece[0].numel() * piece.element_size()
        rows = max(1, self._chunk // max(1, row_bytes))
        need = rows * row_bytes
        if self._staging is None or self._staging.numel() < need:
            self._staging = torch.empty(max(need, self._chunk), dtype=torch.uint8)
        for r in range(0, piece.shape[0], rows):
            block = piece[r : r + rows]
            staged = self._staging[: block.numel() * piece.element_size()].view(piece.dtype).view(block.shape)
            staged.copy_(block)
            self._put(_bytes(staged))

    def close(self, fsync: bool = False) -> str:
        """Finish the file and return its checksum ("" for "none"); every planned tensor must have been written."""
        missing = set(self._offsets) - self._written
        if missing:
            self._file.close()
            raise ValueError(f"{self.path}: {len(missing)} planned tensor(s) never written, e.g. {sorted(missing)[:3]}")
        if fsync:
            self._file.flush()
            os.fsync(self._file.fileno())
        self._file.close()
        if not checksum_enabled(self.checksum):
            return ""
        return str(self._hash.hexdigest()) if self._hashing else file_checksum(self.path, self.checksum)

    def abort(self) -> None:
        """Close without checks (the caller removes the temporary directory)."""
        self._file.close()


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


def _xxh3_128() -> Any:
    import xxhash  # imported only when this checksum is used

    return xxhash.xxh3_128()


def new_checksum(algorithm: str) -> Any:
    """A running checksum: "xxh3_128" (the default: a 128-bit corruption check, ~6 GB/s here), "crc32"
    (32 bits, ~4 GB/s), "sha256" (a cryptographic content digest, ~1.4 GB/s) or "none"."""
    if algorithm not in CHECKSUMS:
        raise ValueError(f"checksum must be one of {CHECKSUMS}, got {algorithm!r}")
    factories: dict[str, Callable[[], Any]] = {
        "xxh3_128": _xxh3_128, "sha256": hashlib.sha256, "crc32": _Crc32, "none": _NoChecksum,
    }  # fmt: skip
    return factories[algorithm]()


def checksum_enabled(algorithm: str) -> bool:
    """False for "none"."""
    return algorithm != "none"


def file_checksum(path: Path, algorithm: str = DEFAULT_CHECKSUM) -> str:
    """Checksum of a whole file, read into one reused buffer chunk by chunk."""
    h = new_checksum(algorithm)
    if checksum_enabled(algorithm):
        buffer = memoryview(bytearray(WRITE_CHUNK))
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                h.update(buffer[:n])
    return str(h.hexdigest())
