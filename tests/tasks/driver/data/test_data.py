"""Users' own data: `datasets` sources (parquet, JSONL, arrow, save_to_disk dirs) in verl's RL schema, the
length filter, bad data as one-line errors naming file/row/column, determinism and epochs. Each test writes
its own small files."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlstages.configs import RunConfig, load_config
from rlstages.configs.data import DataConfig
from rlstages.engines.rollout.batching import format_prompts
from rlstages.tasks.driver.data import loading as D

ROOT = Path(__file__).resolve().parents[4]
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}|{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def verl_rows(n: int, source: str = "openai/gsm8k") -> list[dict]:
    """Rows in verl's RL parquet schema: chat-message prompts, data_source, reward_model, extra_info."""
    return [
        {
            "data_source": source,
            "prompt": [
                {"role": "system", "content": "Think step by step."},
                {"role": "user", "content": f"What is {i} + {i}? Answer after ####."},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
            "extra_info": {"split": "train", "index": i, "question": f"{i}+{i}"},
        }
        for i in range(n)
    ]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def data_cfg(path: str | Path, **extra) -> DataConfig:
    return DataConfig(source={"kind": "datasets", "path": str(path), **extra}, prompts_per_step=3, eval_prompts=4)


def run_cfg(tmp: Path, model_dir: Path, data_path: Path, *extra: str) -> RunConfig:
    return load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"model.path={model_dir}",
            "model.provider=local",
            f"trainer.output_dir={tmp / 'runs'}",
            "data.source={kind: datasets, path: " + str(data_path) + "}",
            "reward.functions=[{name: by_data_source}]",
            *extra,
        ],
    )


def test_verl_parquet_rows_keep_messages_source_truth_and_extra_info(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "train.parquet", verl_rows(5))
    rows = D.load_rows(data_cfg(path), "train")
    assert len(rows) == 5
    r = rows[3]
    assert r.messages[0] == {"role": "system", "content": "Think step by step."}
    assert r.text == "What is 3 + 3? Answer after ####."
    assert (r.ground_truth, r.data_source) == ("6", "openai/gsm8k")
    assert json.loads(r.extra_info) == {"split": "train", "index": 3, "question": "3+3"}


def test_jsonl_arrow_and_saved_dataset_dir_read_the_same_rows(tmp_path: Path) -> None:
    rows = verl_rows(4)
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": ds, "test": ds.select([0, 1])}).save_to_disk(str(saved))
    arrow = tmp_path / "rows.arrow"
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_stream(sink, ds.data.table.schema) as writer:
        writer.write_table(ds.data.table)
    digests = {D.load_split(data_cfg(p), "train").digest for p in (jsonl, saved, arrow)}
    assert len(digests) == 1, "the same rows must have the same digest whatever the file format"
    assert len(D.load_rows(data_cfg(saved), "eval")) == 2  # the `test` split


def test_plain_string_prompts_and_custom_columns(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "qa.parquet", [{"question": "2+2?", "answer": 4, "src": "toy"}])
    cfg = data_cfg(path, prompt_key="question", answer_key="answer", data_source_key="src", extra_info_key=None)
    (row,) = D.load_rows(cfg, "train")
    assert (row.text, row.messages, row.ground_truth, row.data_source) == ("2+2?", (), "4", "toy")


@pytest.mark.parametrize(
    ("rows", "kwargs", "expect"),
    [
        ([{"prompt": "x", "reward_model": {"ground_truth": "1"}}], {"answer_key": "answer"}, "missing column 'answer'"),
        ([{"prompt": 5, "reward_model": {"ground_truth": "1"}}], {}, "row 0: column 'prompt': expected a string"),
        (
            [{"prompt": "a", "reward_model": {"ground_truth": [1]}}],
            {},
            "row 0: column 'reward_model.ground_truth': expected a string or number, got list",
        ),
        (
            [{"prompt": [{"role": "user", "text": "hi"}], "reward_model": {"ground_truth": "1"}}],
            {},
            "row 0: column 'prompt': message 0 is not {role: str, content: str}",
        ),
        (
            [{"prompt": "a", "reward_model": {"ground_truth": "1"}, "extra_info": "oops"}],
            {},
            "row 0: column 'extra_info': expected a dict, got str",
        ),
    ],
)
def test_bad_data_is_one_line_naming_file_row_and_column(tmp_path: Path, rows, kwargs, expect: str) -> None:
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(ValueError) as err:
        D.load_rows(data_cfg(path, **kwargs), "train")
    message = str(err.value)
    assert "\n" not in message and str(path) in message and expect in message, message


def test_empty_and_missing_files_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.parquet"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.parquet: empty file"):
        D.load_rows(data_cfg(empty), "train")
    no_rows = write_parquet(tmp_path / "none.parquet", [])
    with pytest.raises(ValueError, match=r"none\.parquet.*no rows"):
        D.load_rows(data_cfg(no_rows), "train")
    with pytest.raises(FileNotFoundError, match="data.source.path"):
        D.load_rows(data_cfg(tmp_path / "nope" / "x.parquet"), "train")


def test_check_data_refuses_rows_without_ground_truth_for_a_checking_reward(tmp_path: Path, tiny_model_dir) -> None:
    rows = verl_rows(3)
    rows[2]["reward_model"] = {"style": "rule", "ground_truth": None}
    path = write_parquet(tmp_path / "gt.parquet", rows)
    cfg = run_cfg(tmp_path, tiny_model_dir, path)
    with pytest.raises(ValueError, match=r"gt\.parquet: row 2: column 'reward_model.ground_truth': no ground truth"):
        D.check_data(cfg)
    D.check_data(run_cfg(tmp_path, tiny_model_dir, path, "reward.functions=[{name: digit_ratio}]"))  # needs none


def test_length_filter_drops_and_counts_or_refuses(tmp_path: Path, tiny_model_dir) -> None:
    rows = [{"prompt": "x" * n, "reward_model": {"ground_truth": "1"}} for n in (5, 50, 8, 80)]
    path = write_parquet(tmp_path / "len.parquet", rows)
    cfg = run_cfg(tmp_path, tiny_model_dir, path, "data.max_prompt_length=20", "data.overlong_prompts=drop")
    split = D.load_split(cfg.data, "train", D.tokenizer_path(cfg))
    assert [len(r.text) for r in split.rows] == [5, 8] and split.dropped == 2
    assert D.data_record(cfg)["train"]["dropped"] == 2
    strict = run_cfg(tmp_path, tiny_model_dir, path, "data.max_prompt_length=20", "data.overlong_prompts=error")
    with pytest.raises(ValueError, match=r"len\.parquet: row 1: prompt of \d+ tokens > data.max_prompt_length=20"):
        D.check_data(strict)


def test_custom_chat_template_renders_messages(tiny_model_dir) -> None:
    from rlstages.engines.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    tok.chat_template = TEMPLATE
    row = D.Row("hi", "1", ({"role": "system", "content": "S"}, {"role": "user", "content": "hi"}))
    (ids,) = format_prompts(tok, [row.prompt("u")], True, "ignored: the messages have a system turn")
    assert tok.decode(ids) == "<system>S|<user>hi|<assistant>"


def test_steps_are_deterministic_resume_mid_epoch_and_wrap_into_epochs(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "t.parquet", verl_rows(7))
    cfg = data_cfg(path)
    first = [p.ground_truth for s in range(1, 6) for p in D.prompts_for_step(cfg, s, seed=3)]
    D.load_split.cache_clear()
    again = [p.ground_truth for s in (4, 5) for p in D.prompts_for_step(cfg, s, seed=3)]  # a resume at step 4
    assert again == first[9:15]
    assert sorted(first[:7]) == sorted(str(2 * i) for i in range(7))  # epoch 0 is a permutation of all rows
    assert sorted(first[7:14]) == sorted(str(2 * i) for i in range(7))  # and so is epoch 1
    assert first[:7] != first[7:14]  # reshuffled per epoch
    other = [p.ground_truth for s in range(1, 6) for p in D.prompts_for_step(cfg, s, seed=4)]
    assert other != first


def test_addition_task_two_digit_and_multi_step() -> None:
    import re

    two = DataConfig(source={"kind": "addition", "min_operand": 10, "max_operand": 99}, prompts_per_step=1)
    for row in D.load_rows(two, "train")[:200]:
        a, b = map(int, re.findall(r"\d+", row.text))
        assert 10 <= a <= 99 and 10 <= b <= 99 and row.ground_truth == str(a + b)
    three = DataConfig(source={"kind": "addition", "terms": 3, "template": "Compute {expr}."}, prompts_per_step=1)
    for row in D.load_rows(three, "eval"):
        terms = list(map(int, re.findall(r"\d+", row.text)))
        assert len(terms) == 3 and row.ground_truth == str(sum(terms))


def test_hub_dataset_name_resolves_offline_from_a_temporary_hf_cache(tmp_path: Path, monkeypatch) -> None:
    # the hub's cache layout (datasets--org--name/snapshots/<rev>/data/<split>-*.parquet, refs/main), as a
    # download leaves it; offline, the name resolves there and the splits come from the file names
    commit = "d" * 40
    repo = tmp_path / "hf" / "hub" / "datasets--acme--verl-arith"
    (repo / "snapshots" / commit / "data").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    write_parquet(repo / "snapshots" / commit / "data" / "train-00000-of-00001.parquet", verl_rows(5))
    write_parquet(repo / "snapshots" / commit / "data" / "test-00000-of-00001.parquet", verl_rows(2, "lighteval/MATH"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = data_cfg("acme/verl-arith")
    train, held_out = D.load_rows(cfg, "train"), D.load_rows(cfg, "eval")
    assert len(train) == 5 and len(held_out) == 2
    assert {r.data_source for r in held_out} == {"lighteval/MATH"} and train[3].ground_truth == "6"
    with pytest.raises(ValueError, match="acme/absent"):  # a name the cache does not hold: one line, named
        D.load_rows(data_cfg("acme/absent"), "train")


def test_a_multi_turn_runs_response_budget_is_its_trajectorys(tmp_path: Path, tiny_model_dir) -> None:
    """With multi-turn rollouts a row's response is the trajectory (`multi_turn.max_response_tokens`), and
    rollout.max_new_tokens caps nothing: the context check, the overlong penalty and the memory plan read the
    trajectory's budget (`rollout.response_budget`), and an error names the setting it came from."""
    from rlstages.tasks.driver.checks import PreflightError
    from rlstages.tasks.driver.data.checks import check_prompt_lengths
    from rlstages.tasks.driver.memory_plan.rank import prompt_tokens, sequence_tokens
    from rlstages.tasks.reward import length_penalty

    path = write_parquet(tmp_path / "mt.parquet", verl_rows(3))
    tools = ["rollout.multi_turn.enabled=true", "rollout.multi_turn.environment={tools: [{name: calculator}]}"]
    single = run_cfg(tmp_path, tiny_model_dir, path, "rollout.max_new_tokens=600")
    with pytest.raises(PreflightError, match=r"^rollout\.max_new_tokens: 600 leaves no room for a prompt"):
        check_prompt_lengths(single)
    budget = ["rollout.multi_turn.max_response_tokens=64", "rollout.multi_turn.per_turn_max_tokens=32"]
    multi = run_cfg(tmp_path, tiny_model_dir, path, "rollout.max_new_tokens=600", *tools, *budget)
    assert multi.rollout.response_budget == 64 and check_prompt_lengths(multi) == []
    assert sequence_tokens(multi) == prompt_tokens(multi) + 64
    tight = ["rollout.multi_turn.max_response_tokens=500", "rollout.multi_turn.per_turn_max_tokens=32"]
    truncate = "data.overlong_prompts=truncate"
    kept = check_prompt_lengths(run_cfg(tmp_path, tiny_model_dir, path, *tools, *tight, truncate))
    assert kept and "(context 512 - rollout.multi_turn.max_response_tokens) are kept whole" in kept[0], kept
    cut = check_prompt_lengths(run_cfg(tmp_path, tiny_model_dir, path, "rollout.max_new_tokens=500", truncate))
    assert cut and "are truncated to their last 12 tokens" in cut[0], cut  # the single-turn engine cuts them
    long = run_cfg(tmp_path, tiny_model_dir, path, *tools, "rollout.multi_turn.max_response_tokens=600")
    with pytest.raises(PreflightError, match=r"^rollout\.multi_turn\.max_response_tokens: 600 leaves no room"):
        check_prompt_lengths(long)
    penalised = ["algorithm.overlong.enable=true", "algorithm.overlong.buffer_len=16", "rollout.max_new_tokens=32"]
    lengths = torch.tensor([8, 40, 56, 64])
    one_turn = length_penalty(run_cfg(tmp_path, tiny_model_dir, path, *penalised), lengths)
    turns = ["rollout.multi_turn.max_response_tokens=64", "rollout.multi_turn.per_turn_max_tokens=8"]
    trajectory = length_penalty(run_cfg(tmp_path, tiny_model_dir, path, *penalised, *tools, *turns), lengths)
    assert one_turn is not None and one_turn.tolist() == [0.0, -1.5, -2.5, -3.0]  # against max_new_tokens' 32
    assert trajectory is not None and trajectory.tolist() == [0.0, 0.0, -0.5, -1.0]  # against the trajectory's 64
