"""The rank-file writer: chunked, hash-as-you-write streaming of contiguous, strided and row-concatenated
tensors gives bit-exact files whose in-stream checksum equals an independent checksum of the bytes on disk.

Run: .venv/bin/pytest tests/engines/convert/test_convert_checksum.py -q   (CPU only, ~2 s)
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path

import pytest
import torch
import xxhash
from convert_fixtures import make_hf_model
from safetensors.torch import load_file

from rlstages.engines.convert import RowConcat, convert_hf_to_mcore, verify_manifest
from rlstages.engines.convert.safetensors_io import DEFAULT_CHECKSUM, Planned, PlannedWriter, file_checksum

REFERENCE = {
    "xxh3_128": lambda data: xxhash.xxh3_128(data).hexdigest(),
    "crc32": lambda data: f"{zlib.crc32(data):08x}",
    "sha256": lambda data: hashlib.sha256(data).hexdigest(),
}


def _tensors() -> dict[str, torch.Tensor | RowConcat]:
    """A row-parallel shard (a strided view), a column piece list, a 1-D strided slice, bf16 and fp32."""
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(37, 24, generator=gen).to(torch.bfloat16)
    a, b = torch.randn(5, 12, generator=gen), torch.randn(7, 12, generator=gen)
    return {
        "row_shard": full.chunk(2, dim=1)[1],  # non-contiguous: gathered through the staging buffer
        "pieces": RowConcat((a[1:4], b, a[:1])),
        "strided_1d": torch.arange(40, dtype=torch.int32)[::3],
        "plain": torch.randn(3, 5, 2, generator=gen),
        "empty": torch.empty(0, 4),
    }


def _plain(t: torch.Tensor | RowConcat) -> torch.Tensor:
    return t.materialize() if isinstance(t, RowConcat) else t.contiguous()


@pytest.mark.parametrize("chunk_bytes", [1, 64, 1000, 1 << 20])
@pytest.mark.parametrize("algorithm", ["xxh3_128", "crc32", "sha256"])
def test_streamed_checksum_matches_the_file(tmp_path: Path, algorithm: str, chunk_bytes: int) -> None:
    tensors = _tensors()
    plan = [Planned(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    path = tmp_path / "rank.safetensors"
    writer = PlannedWriter(path, plan, {"tp_rank": "0"}, algorithm, chunk_bytes=chunk_bytes)
    for name, t in tensors.items():
        writer.write(name, t)
    digest = writer.close()
    assert digest == REFERENCE[algorithm](path.read_bytes()) == file_checksum(path, algorithm)
    back = load_file(path)
    for name, t in tensors.items():
        assert torch.equal(back[name], _plain(t)), name


def test_out_of_order_writes_fall_back_to_a_re_read(tmp_path: Path) -> None:
    tensors = _tensors()
    plan = [Planned(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    path = tmp_path / "rank.safetensors"
    writer = PlannedWriter(path, plan, chunk_bytes=64)
    for name in reversed(list(tensors)):
        writer.write(name, tensors[name])
    assert writer.close() == REFERENCE[DEFAULT_CHECKSUM](path.read_bytes())
    assert all(torch.equal(t, _plain(tensors[n])) for n, t in load_file(path).items())


def test_default_manifest_checksum_catches_a_flipped_byte_in_the_middle(tmp_path: Path) -> None:
    hf = make_hf_model(tmp_path / "qwen2", "qwen2")
    out = convert_hf_to_mcore(hf, tmp_path / "m", tp=2, pp=2, fsync=False)
    manifest = verify_manifest(out)
    rank = out / "mp_rank_01_001" / "model.safetensors"
    assert manifest["checksum"] == DEFAULT_CHECKSUM
    assert (
        manifest["files"]["mp_rank_01_001/model.safetensors"][DEFAULT_CHECKSUM]
        == xxhash.xxh3_128(rank.read_bytes()).hexdigest()
    )
    data = bytearray(rank.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size: only the checksum can tell
    rank.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"mp_rank_01_001/model\.safetensors: size or xxh3_128 differs"):
        verify_manifest(out)
