"""HF rollout engine vs raw `model.generate` on the same prompts and sampling (goal: throughput ratio >= 0.95),
and image prompts' shared prefill against prefilling every row (informative).

The engine does more than generate (chat formatting, per-token log-probs, the batch contract); this
measures what that costs. `python -m bench.bench_rollout`
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import torch

from bench.common import best_of, record, report, small_model
from rlstages.engines.rollout.hf_rollout import HFRolloutEngine
from rlstages.engines.types import Prompt, SamplingParams


def main(batch: int = 32, new_tokens: int = 48) -> None:
    """Time both on `batch` prompts x `new_tokens` sampled tokens (min_new_tokens forces the same length)."""
    torch.set_num_threads(1)
    path = small_model()
    engine = HFRolloutEngine(path, dtype="float32", batch_size=batch, apply_chat_template=False)
    prompts = [Prompt(f"p{i}", f"What is {i} + {i % 7}? Reply with only the number.", "0") for i in range(batch)]
    ids = [engine.tokenizer(p.text)["input_ids"] for p in prompts]
    enc = engine.tokenizer.pad({"input_ids": ids}, padding=True, return_tensors="pt")
    eos = sorted(engine.eos_ids)

    def raw() -> None:
        torch.manual_seed(0)
        with torch.no_grad():
            engine.model.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_k=None,
                top_p=None,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                eos_token_id=eos,
                pad_token_id=engine.pad_id,
            )

    forced = SamplingParams(n=1, max_new_tokens=new_tokens)
    engine.eos_ids = set()  # same length as the raw call: no early stop on either side

    def ours() -> None:
        engine.generate(prompts, forced, seed=0)

    base_s, ours_s = best_of(raw), best_of(ours)
    tokens = batch * new_tokens
    report(
        "HF rollout engine vs model.generate (throughput ratio = baseline/ours; goal >= 0.95)",
        [(f"{batch} x {new_tokens} tokens, {tokens / ours_s:,.0f} tok/s", ours_s, base_s, "base/ours >= 0.95")],
    )
    record(
        "rollout_engine_throughput", base_s / ours_s, ">= 0.95", f"{tokens / ours_s:,.0f} tok/s, engine / raw generate"
    )


def image_prefix_sharing(prompts: int = 8, n: int = 8, new_tokens: int = 16) -> None:
    """The decode loop on `prompts` image prompts (16 image tokens each) x `n` samples: each prompt's prefill
    shared by its rows (the engine's) vs every row prefilled whole; ratio = whole / shared (> 1: sharing wins)."""
    from PIL import Image

    from rlstages.engines.models.vision import build_tiny_vlm
    from rlstages.engines.rollout.decode import decode, picker
    from rlstages.engines.rollout.vision_inputs import ImageBatch, encode_image_prompts

    torch.set_num_threads(1)
    path = Path(tempfile.gettempdir()) / "rlstages-bench-vlm-256x4"
    if not (path / "config.json").is_file():
        build_tiny_vlm(path, hidden_size=256, intermediate_size=768, num_hidden_layers=4, vision_width=128)
    engine = HFRolloutEngine(path, dtype="float32", apply_chat_template=False)

    def png(i: int) -> bytes:
        buf = io.BytesIO()
        Image.new("RGB", (112, 112), (40 * i % 256, 90, 160)).save(buf, format="PNG")
        return buf.getvalue()

    items = [
        Prompt(f"p{i}", "<image>What colour is the square? Answer in one word.", "red", images=(png(i),))
        for i in range(prompts)
    ]
    encoded = encode_image_prompts(engine.model, engine.tokenizer, engine.image_processor, items, False, None)
    rows = [p for p in encoded for _ in range(n)]
    enc = engine.tokenizer.pad({"input_ids": [p.ids for p in rows]}, padding=True, return_tensors="pt")
    pick = picker(1.0, 0, 1.0, False)

    def run(share: bool) -> None:
        images = ImageBatch.of(rows, enc["input_ids"].shape[1], torch.device("cpu"), share)
        torch.manual_seed(0)
        decode(engine.model, enc["input_ids"], enc["attention_mask"], new_tokens, set(), pick, images=images)

    shared_s, whole_s = best_of(lambda: run(True), 2), best_of(lambda: run(False), 2)
    report(
        "Image prompts: shared prefill vs every row's (ratio = whole/shared)",
        [(f"{prompts} prompts x {n} samples x {new_tokens} tokens", shared_s, whole_s, "informative")],
    )
    record("rollout_image_prefix_sharing", whole_s / shared_s, None, f"{prompts}x{n} rows, {new_tokens} tokens")


if __name__ == "__main__":
    main()
    image_prefix_sharing()
