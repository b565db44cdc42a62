"""The shared-memory file of a same-node sync group: bucket payloads pass through it instead of the socket.

The source casts each tensor straight into its own region of a file under /dev/shm, mapped by every member and
reused by every sync; the file grows (a new, larger one: a new generation) when the weights outgrow it, and each
new file is unlinked once every receiver has mapped it (`unlink_mapped`): the memory lives as long as the mappings,
so a killed worker leaves nothing behind.
"""

from __future__ import annotations

import torch

from rlstages.engines.sync.collective.membership import SyncGroup


def shared_region(member: SyncGroup, offset: int, nbytes: int, generation: int | None = None) -> torch.Tensor:
    """Bytes [offset, offset + nbytes) of this process's mapping of the group's shared-memory file. The source
    (no `generation`) makes a new file, twice as large or more, when the region does not fit; a receiver maps the
    file of the `generation` the header names. Views taken earlier keep their own file mapped."""
    import os

    assert member.shm_path is not None
    end = offset + nbytes
    if generation is None and (member.mapping is None or member.mapping.numel() < end):
        size = max(end, 2 * (member.mapping.numel() if member.mapping is not None else 0))
        member.generation += 1
        member.created.append(f"{member.shm_path}.{member.generation}")
        member.mapping = torch.from_file(member.created[-1], shared=True, size=size, dtype=torch.uint8)
    elif generation is not None and generation != member.generation:
        path = f"{member.shm_path}.{generation}"
        member.mapping = torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)
        member.generation = generation
    assert member.mapping is not None
    return member.mapping[offset:end]


def unlink_mapped(member: SyncGroup) -> None:
    """After the final all-reduce (every receiver has mapped the files): unlink the newly made ones."""
    import contextlib
    import os

    for path in member.created:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    member.created = []


def align(offset: int) -> int:
    """`offset` rounded up to a cache line (each bucket's region starts on one)."""
    return -(-offset // 64) * 64  # each bucket's region starts on a cache line
