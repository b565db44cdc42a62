"""The batch contract between stages: field names, shapes, and helpers on `tensordict.TensorDict`.

A batch is a TensorDict with batch size [B] (B = prompts x n samples). Shapes, P = prompt length
(left-padded), T = response length (right-padded):

    prompt_ids        [B, P]    int64, left-padded with the pad id
    response_ids      [B, T]    int64, right-padded with the pad id
    attention_mask    [B, P+T]  int64, 1 on real prompt and response tokens
    position_ids      [B, P+T]  int64, cumsum(attention_mask) - 1, clamped at 0
    response_mask     [B, T]    float32, 1 on generated tokens up to and including EOS
    rollout_logprobs  [B, T]    float32, log-prob of each sampled token under the rollout engine
    rollout_versions  [B, T]    int64, the policy version that sampled each token (0 on padding)
    old_logprobs      [B, T]    float32, trainer log-probs before the update
    ref_logprobs      [B, T]    float32, reference-policy log-probs
    values            [B, T]    float32, critic values
    token_rewards     [B, T]    float32, outcome score at the last response token (minus KL if in reward)
    advantages        [B, T]    float32
    returns           [B, T]    float32
    rollout_is_weights [B, T]   float32, detached pi_old / pi_rollout weights (only with algorithm.rollout_is)
    scores            [B]       float32, the reward of each sample
    rope_position_ids [B, 3, P+T] int64, M-RoPE positions (temporal, height, width) of an image model's rows

Image rows also carry `multi_modal_inputs`: per row, unpadded, a dict of tensors (`pixel_values`,
`image_grid_thw`) as the image processor made them (`get_multi_modal`; files keep them as `__mm__.<row>.<name>`).
Between Ray actors they travel without pickled copies (`MultiModalRow`): one object per prompt group, its tensors
as pickle-5 buffers that Ray reads back from its object store as read-only shared memory.

Per-row non-tensor fields (lists of str, travel with split/cat/index): uid (group id of the prompt),
prompt, response, ground_truth, data_source, extra_info (a JSON object as text).

Non-goal: knowing about models or tokenizers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rlstages.engines.tensordict_import import NonTensorData, NonTensorStack, TensorDict

PROMPT_IDS = "prompt_ids"
RESPONSE_IDS = "response_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
RESPONSE_MASK = "response_mask"
ROLLOUT_LOGPROBS = "rollout_logprobs"
OLD_LOGPROBS = "old_logprobs"
REF_LOGPROBS = "ref_logprobs"
VALUES = "values"
TOKEN_REWARDS = "token_rewards"
ADVANTAGES = "advantages"
RETURNS = "returns"
SCORES = "scores"
ROLLOUT_IS_WEIGHTS = "rollout_is_weights"
ROLLOUT_VERSIONS = "rollout_versions"
ROPE_POSITION_IDS = "rope_position_ids"
MULTI_MODAL_INPUTS = "multi_modal_inputs"
_MM_PREFIX = "__mm__."
ROW_FIELDS = ("uid", "prompt", "response", "ground_truth", "data_source", "extra_info")

# The types every engine layer shares (here, at the bottom, so that no import points up the layers):
NamedTensors = Iterable[tuple[str, torch.Tensor]]  # HF-named weights, streamed one tensor at a time
Bucket = list[tuple[str, str, np.ndarray]]  # an object-store weight bucket: (name, dtype, encoded array)


@dataclass(frozen=True)
class Prompt:
    """One prompt row as it leaves the data stage: its group id, text, and the answer to check against.

    `messages` (chat turns `{"role", "content"}`) replace `text` for the chat template when given; `text`
    is then the last user turn. `data_source` and `extra_info` (JSON object text) reach the reward function.
    `images`: encoded image files (PNG, JPEG, ...) for the `<image>` placeholders of the text, in order.
    """

    uid: str
    text: str
    ground_truth: str
    messages: tuple[dict[str, str], ...] = ()
    data_source: str = ""
    extra_info: str = "{}"
    images: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """What a rollout engine needs to sample; `temperature == 0` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        """True when sampling degenerates to argmax decoding."""
        return self.temperature == 0.0


def make_batch(tensors: dict[str, torch.Tensor], rows: Mapping[str, Sequence[str]]) -> TensorDict:
    """Build a batch from [B, ...] tensors and per-row string lists of length B."""
    size = next(iter(tensors.values())).shape[0]
    td = TensorDict(dict(tensors), batch_size=[size])
    for key, values in rows.items():
        set_rows(td, key, values)
    return td


def set_rows(td: TensorDict, key: str, values: Sequence[str]) -> None:
    """Attach a per-row list of strings to a batch."""
    if len(values) != td.batch_size[0]:
        raise ValueError(f"row field {key!r} has {len(values)} values for a batch of {td.batch_size[0]}")
    td[key] = NonTensorStack.from_list([str(v) for v in values])  # type: ignore[misc]  # .pyi: List[Mapping]; takes Any


def get_rows(td: TensorDict, key: str) -> list[str]:
    """A per-row string field as a plain list."""
    value = td.get(key)
    return list(value.tolist()) if hasattr(value, "tolist") else list(value)


class MultiModalRow(dict):
    """One row's image inputs ({name: tensor}). Pickled as numpy arrays: Ray (pickle protocol 5) keeps them out of
    band, so an actor reads them back as read-only views of its object store's shared memory (no copy, never
    written: the model concatenates them); the rows of a prompt group hold one object, pickled once. Plain pickle
    (in-band bytes) reads back writable tensors. Tensors numpy cannot hold (bfloat16) pickle as tensors.
    `shared`: read back as views of read-only (shared) memory."""

    shared = False

    def __reduce__(self) -> tuple[object, tuple[dict[str, object]]]:
        return _multi_modal_row, ({k: _as_numpy(v) for k, v in self.items()},)


def _as_numpy(t: torch.Tensor) -> object:
    try:
        return t.detach().cpu().numpy()
    except TypeError:  # a dtype numpy lacks
        return t


def _multi_modal_row(arrays: dict[str, object]) -> MultiModalRow:
    import warnings

    with warnings.catch_warnings():  # read-only object-store memory: torch warns that it is not writable
        warnings.simplefilter("ignore", UserWarning)
        row = MultiModalRow({k: torch.from_numpy(a) if isinstance(a, np.ndarray) else a for k, a in arrays.items()})
    row.shared = any(isinstance(a, np.ndarray) and not a.flags.writeable for a in arrays.values())
    return row


def set_multi_modal(td: TensorDict, inputs: Sequence[dict[str, torch.Tensor]]) -> None:
    """Attach each row's unpadded image inputs ({name: tensor}, e.g. pixel_values, image_grid_thw); rows given the
    same dict (a prompt group's n samples) share one `MultiModalRow`."""
    if len(inputs) != td.batch_size[0]:
        raise ValueError(f"multi_modal_inputs: {len(inputs)} rows for a batch of {td.batch_size[0]}")
    rows: dict[int, MultiModalRow] = {}
    shared = [rows.setdefault(id(mm), mm if isinstance(mm, MultiModalRow) else MultiModalRow(mm)) for mm in inputs]
    td[MULTI_MODAL_INPUTS] = NonTensorStack(*[NonTensorData(mm) for mm in shared])


def get_multi_modal(td: TensorDict) -> list[dict[str, torch.Tensor]]:
    """Each row's image inputs (empty dicts when the batch has none)."""
    if MULTI_MODAL_INPUTS not in td.keys():
        return [{} for _ in range(td.batch_size[0])]
    return list(td.get(MULTI_MODAL_INPUTS).tolist())


def row_keys(td: TensorDict) -> list[str]:
    """Names of the per-row string fields present."""
    keys = [k for k in td.keys() if not isinstance(td.get(k), torch.Tensor) and k != MULTI_MODAL_INPUTS]
    return cast("list[str]", keys)  # top-level keys are str (nested tuples only with include_nested)


def tensor_keys(td: TensorDict) -> list[str]:
    """Names of the tensor fields present."""
    keys = [k for k in td.keys() if isinstance(td.get(k), torch.Tensor)]
    return cast("list[str]", keys)  # top-level keys are str (nested tuples only with include_nested)


# [B, response width] fields, padded on the right when batches join (`same_widths`; the attention mask and the
# position ids span prompt + response and are split at the prompt's width)
RESPONSE_SIDE = (RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOGPROBS, ROLLOUT_VERSIONS, OLD_LOGPROBS, REF_LOGPROBS, VALUES,
                 TOKEN_REWARDS, ADVANTAGES, RETURNS, ROLLOUT_IS_WEIGHTS)  # fmt: skip


def concat(batches: Sequence[TensorDict]) -> TensorDict:
    """Concatenate batches along rows (tensor and per-row fields alike). Rollout batches of different engines
    (data-parallel ranks) are each as wide as their own longest prompt and reply: the narrower ones are padded to
    the widest first (`same_widths`)."""
    parts: list[Any] = list(batches)
    if len(parts) > 1 and all(PROMPT_IDS in b.keys() and RESPONSE_IDS in b.keys() for b in parts):
        parts = same_widths(parts)
    return cast(TensorDict, torch.cat(parts, dim=0))  # TensorDict overrides torch.cat


def same_widths(batches: list[TensorDict]) -> list[TensorDict]:
    """Rollout batches padded to one prompt width (on the left, as generation pads prompts) and one response
    width (on the right): ids with the batches' own pad id, masks, log-probs and the like with 0, position ids
    with their row's edge values. A field of another width that differs between the batches is refused."""
    widths = [(b[PROMPT_IDS].shape[1], b[RESPONSE_IDS].shape[1]) for b in batches]
    prompt, response = max(w[0] for w in widths), max(w[1] for w in widths)
    if all(w == (prompt, response) for w in widths):
        return batches
    pad_id = _pad_id(batches)
    out = []
    for b, (p, r) in zip(batches, widths, strict=True):
        left, right = prompt - p, response - r
        if not left and not right:
            out.append(b)
            continue
        b = b.clone(recurse=False)
        for key in tensor_keys(b):
            t = b.get(key)
            if key == PROMPT_IDS:
                b.set(key, _pad(t, left, 0, pad_id))
            elif key == RESPONSE_IDS:
                b.set(key, _pad(t, 0, right, pad_id))
            elif key in RESPONSE_SIDE:
                b.set(key, _pad(t, 0, right, 0))
            elif key == ATTENTION_MASK:
                b.set(key, torch.cat([_pad(t[:, :p], left, 0, 0), _pad(t[:, p:], 0, right, 0)], dim=1))
            elif key == POSITION_IDS:
                b.set(key, torch.cat([_pad(t, left, 0, 0), t[:, -1:].expand(-1, right)], dim=1))
            elif t.dim() >= 2 and any(o.get(key).shape[1:] != t.shape[1:] for o in batches if key in o.keys()):
                raise ValueError(f"batches to concatenate differ in the width of {key!r}: no rule to pad it")
        out.append(b)
    return out


def _pad(t: torch.Tensor, left: int, right: int, value: float) -> torch.Tensor:
    return torch.nn.functional.pad(t, (left, right), value=value) if left or right else t


def _pad_id(batches: list[TensorDict]) -> int:
    """The pad id the batches already use (a padded prompt or reply position of any of them), else 0."""
    for b in batches:
        mask = b[ATTENTION_MASK]
        prompt_pads = b[PROMPT_IDS][mask[:, : b[PROMPT_IDS].shape[1]] == 0]
        reply_pads = b[RESPONSE_IDS][mask[:, b[PROMPT_IDS].shape[1] :] == 0]
        for pads in (prompt_pads, reply_pads):
            if pads.numel():
                return int(pads[0])
    return 0


def chunk_for_ranks(td: TensorDict, ranks: int) -> list[TensorDict]:
    """Split rows into `ranks` contiguous, near-equal parts (data-parallel dispatch); order is kept."""
    size = td.batch_size[0]
    bounds = [size * r // ranks for r in range(ranks + 1)]
    return [td[bounds[r] : bounds[r + 1]] for r in range(ranks)]


def pad_right(seqs: Sequence[Sequence[int]], pad: int, length: int | None = None) -> torch.Tensor:
    """Right-pad integer sequences into an int64 [B, L] tensor."""
    width = length if length is not None else max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(list(s)[:width], dtype=torch.long)
    return out


def pad_left(seqs: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """Left-pad integer sequences into an int64 [B, L] tensor (prompts for decoder-only generation)."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            out[i, width - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
    return out


def position_ids_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: cumsum(mask) - 1, clamped at 0."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def save_batch(td: TensorDict, path: str | Path) -> Path:
    """Write a batch atomically as one safetensors file (per-row strings in its metadata)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: td.get(k).contiguous() for k in tensor_keys(td)}
    same: dict[int, int] = {}  # rows whose image inputs are another row's (a group's n samples): stored once
    if MULTI_MODAL_INPUTS in td.keys():
        first: dict[tuple[int, ...], int] = {}
        for i, mm in enumerate(get_multi_modal(td)):
            key = tuple(id(t) for t in mm.values())
            if key in first and mm:
                same[i] = first[key]
                continue
            first[key] = i
            tensors.update({f"{_MM_PREFIX}{i}.{name}": t.contiguous() for name, t in mm.items()})
    meta = {"rows": json.dumps({k: get_rows(td, k) for k in row_keys(td)}), "size": str(td.batch_size[0])}
    if same:
        meta["mm_same"] = json.dumps(same)
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return path


def load_batch(path: str | Path) -> TensorDict:
    """Read a batch written by `save_batch`."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no batch file (was the producing stage run?)")
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    rows = json.loads(meta.get("rows", "{}"))
    size = int(meta.get("size", "0"))
    mm: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for key in [k for k in tensors if k.startswith(_MM_PREFIX)]:
        row, name = key[len(_MM_PREFIX) :].split(".", 1)
        mm[int(row)][name] = tensors.pop(key)
    for row, source in json.loads(meta.get("mm_same", "{}")).items():
        mm[int(row)] = mm[source]
    td = TensorDict(tensors, batch_size=[size])
    for key, values in rows.items():
        set_rows(td, key, values)
    if any(mm):
        set_multi_modal(td, mm)
    return td
