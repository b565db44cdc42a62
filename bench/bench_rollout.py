"""HF rollout engine vs raw `model.generate` on the same prompts and sampling (goal: throughput ratio >= 0.95).

The engine does more than generate (chat formatting, per-token log-probs, the batch contract); this
measures what that costs. `python -m bench.bench_rollout`
"""

from __future__ import annotations

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


if __name__ == "__main__":
    main()
