"""Config schema, presets, overrides and cross-field checks. CPU only: `pytest tests/configs`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlstages.configs import ConfigError, RunConfig, config_hash, flatten, load_config
from rlstages.configs.loader import build_config, read_yaml

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))


def tiny() -> dict:
    return read_yaml(ROOT / "configs" / "tiny.yaml")


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads(preset: Path) -> None:
    cfg = load_config(preset)
    assert isinstance(cfg, RunConfig)
    assert cfg.trainer.total_steps >= 1


def test_presets_cover_the_seeds_layouts() -> None:
    names = {p.stem for p in PRESETS}
    assert {"demo", "tiny", "qwen2_7b_grpo_megatron", "deepspeed_vllm"} <= names
    mega = load_config(ROOT / "configs" / "qwen2_7b_grpo_megatron.yaml")
    assert mega.actor.backend == "megatron" and mega.actor.data_parallel_size == 2
    assert mega.actor.param_offload and mega.rollout.backend == "vllm"
    ds = load_config(ROOT / "configs" / "deepspeed_vllm.yaml")
    assert ds.actor.backend == "deepspeed" and ds.actor.zero_stage == 3 and ds.critic is not None


def test_overrides_are_typed_by_the_schema() -> None:
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["actor.optim.lr=1e-6", "rollout.n=8", "rollout.stop=[x, y]"])
    assert cfg.actor.optim.lr == pytest.approx(1e-6) and isinstance(cfg.actor.optim.lr, float)
    assert cfg.rollout.n == 8 and cfg.rollout.stop == ("x", "y")


def test_override_switches_backend_with_its_own_options() -> None:
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["actor.backend=deepspeed", "actor.zero_stage=3"])
    assert cfg.actor.backend == "deepspeed" and cfg.actor.zero_stage == 3


def test_bf16_stochastic_rounding_is_the_torch_backends_option() -> None:
    base = ["model.dtype=bfloat16", "actor.bf16_stochastic_round=true"]
    assert load_config(ROOT / "configs" / "tiny.yaml", base).actor.bf16_stochastic_round
    with pytest.raises(ConfigError, match="actor.bf16_stochastic_round: unknown key"):
        load_config(ROOT / "configs" / "tiny.yaml", ["actor.backend=deepspeed", *base])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("actor.optim.lrr=1", "actor.optim.lrr: unknown key (not in the schema); did you mean lr?"),
        ("trainer.totl_steps=3", "did you mean total_steps?"),  # a misspelling: the section's closest keys
        ("reward.functions.0.nme=x", "did you mean name?"),  # inside a list's item
        ("actor.optim.lr=abc", "actor.optim.lr: Input should be a valid number"),
        ("actor.zero_stage=3", "actor.zero_stage: unknown key"),  # torch backend has no zero_stage
        ("rollout.backend=trt", "rollout"),
        ("reward.functions.5.name=x", "not an index"),
        (
            "actor.fp32_matmul=maybe",
            "actor.fp32_matmul: Input should be a valid boolean, unable to interpret input, or 'auto' (got 'maybe')",
        ),
    ],
)
def test_bad_override_names_the_field(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "configs" / "tiny.yaml", [override])
    message = str(info.value)
    assert needle in message and "\n" not in message


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"rollout": {"n": 1}}, "needs rollout.n > 1"),
        ({"algorithm": {"adv_estimator": "gae"}}, "add a `critic:` section"),
        ({"actor": {"mini_batch_size": 3}}, "must divide data.prompts_per_step"),
        ({"actor": {"micro_batch_size": 5}}, "must divide a mini-batch of 16 sequences"),
        ({"algorithm": {"use_kl_in_reward": True, "use_kl_loss": True}}, "penalises KL twice"),
        (
            {"actor": {"backend": "megatron", "tensor_model_parallel_size": 3, "num_workers": 3}},
            "must divide the model's attention heads (4) and KV groups (2)",
        ),
        (
            {"actor": {"backend": "megatron", "pipeline_model_parallel_size": 3, "num_workers": 3}},
            "must divide the model's 2 layers",
        ),
        (
            {"actor": {"backend": "megatron", "tensor_model_parallel_size": 2, "num_workers": 3}},
            "not a multiple of TP x PP x CP",
        ),
        ({"actor": {"backend": "deepspeed", "zero_stage": 2, "offload_param": True}}, "needs zero_stage 3"),
        (
            {"cluster": {"num_gpus": 2, "colocate": False}, "actor": {"backend": "deepspeed", "num_workers": 2}},
            "asks for 3 GPUs",
        ),
        ({"actor": {"bf16_stochastic_round": True}}, "set model.dtype: bfloat16"),
        ({"actor": {"optim": {"decay_steps": 4, "min_lr_ratio": 0.1}}}, "decay_steps, min_lr_ratio shape only"),
    ],
)
def test_cross_field_checks_say_what_and_how(changes: dict, needle: str) -> None:
    data = tiny()
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ConfigError) as info:
        build_config(data)
    assert needle in str(info.value)


def test_a_resolved_constant_schedule_loads_again() -> None:
    """A run's resolved config writes the cosine-only fields out at their defaults: that is not asking for them."""
    data = tiny()
    data["actor"] = {**data["actor"], "optim": {"schedule": "constant", "min_lr_ratio": 0.0, "decay_steps": None}}
    assert build_config(data).actor.optim.schedule == "constant"


def test_kl_in_reward_and_loss_allowed_when_asked() -> None:
    data = tiny()
    data["algorithm"] = {
        **data["algorithm"],
        "use_kl_in_reward": True,
        "use_kl_loss": True,
        "allow_kl_in_reward_and_loss": True,
    }
    cfg = build_config(data)
    assert cfg.uses_reference


def test_openmp_spins_only_for_a_lone_hybrid_worker() -> None:
    demo = load_config(ROOT / "configs" / "demo.yaml")
    assert not demo.omp_passive  # one process does all the torch work: let its idle threads spin briefly
    with_ref = load_config(ROOT / "configs" / "demo.yaml", ["reference.enabled=true"])
    assert with_ref.omp_passive  # reference worker computes concurrently with the actor
    split = load_config(ROOT / "configs" / "demo.yaml", ["cluster.hybrid_engine=false"])
    assert split.omp_passive
    forced = load_config(ROOT / "configs" / "demo.yaml", ["cluster.omp_wait_policy=passive"])
    assert forced.omp_passive


def test_make_demo_async_is_the_demo_trained_asynchronously() -> None:
    # the Makefile's `demo-async` overrides, read from the Makefile: a valid async run of the demo's task and model
    makefile = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    overrides = next(line for line in makefile.splitlines() if line.startswith("ASYNC :=")).split(":=")[1].split()
    cfg, demo = load_config(ROOT / "configs" / "demo.yaml", overrides), load_config(ROOT / "configs" / "demo.yaml")
    assert cfg.trainer.mode == "async" and cfg.trainer.async_.max_staleness == 1 and not cfg.cluster.hybrid_engine
    assert cfg.algorithm.decoupled_loss and cfg.omp_passive  # two workers compute at once: idle threads sleep
    same = (cfg.model, cfg.data, cfg.rollout, cfg.actor.optim)
    assert same == (demo.model, demo.data, demo.rollout, demo.actor.optim)


def test_colocated_gpus_fit() -> None:
    data = tiny()
    data["cluster"] = {"num_gpus": 2, "colocate": True}
    data["actor"] = {**data["actor"], "backend": "deepspeed", "num_workers": 2}
    assert build_config(data).cluster.num_gpus == 2


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: line .* is not valid YAML"):
        load_config(bad)


def test_frozen_and_hash_stable() -> None:
    a = load_config(ROOT / "configs" / "tiny.yaml")
    b = load_config(ROOT / "configs" / "tiny.yaml")
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash(load_config(ROOT / "configs" / "tiny.yaml", ["trainer.seed=1"]))
    # when a checkpoint commits is not what the run computes: a run resumes with the other setting
    synchronous = load_config(ROOT / "configs" / "tiny.yaml", ["checkpoint.commit_in_background=false"])
    assert config_hash(a) == config_hash(synchronous)
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frozen"):
        a.trainer.total_steps = 5  # type: ignore[misc]
    flat = flatten(a.model_dump(mode="json"))
    assert flat["actor.optim.lr"] == "0.001" and flat["reward.functions.0.name"] == "digit_ratio"


def test_cli_config_show_and_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from rlstages.flows.cli.main import app

    monkeypatch.chdir(ROOT)

    def _cli(*args: str):  # in process (typer's CliRunner), from the repository root
        return CliRunner().invoke(app, list(args), env={"COLUMNS": "2000"})

    # the pre-flight reads the run directory: an empty one, not the checkout's runs/ (a `make demo` leaves runs/demo,
    # whose config this override changes)
    ok = _cli("config", "show", "configs/demo.yaml", "actor.optim.lr=1e-5", f"trainer.output_dir={tmp_path}")
    assert ok.exit_code == 0 and "lr: 1.0e-05" in ok.stdout, (ok.stderr, ok.exception)
    bad = _cli("config", "show", "configs/demo.yaml", "actor.optim.lrr=1")
    assert bad.exit_code == 2
    lines = [line for line in bad.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "actor.optim.lrr" in lines[0]
    helped = _cli("--help")
    for command in ("run", "resume", "eval", "config"):
        assert command in helped.stdout


def test_config_reference_doc_is_current() -> None:
    generated = subprocess.run(
        [sys.executable, "-m", "rlstages.configs.reference"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    assert generated == (ROOT / "docs" / "config-reference.md").read_text(), "run: python -m rlstages.configs.reference"


def test_an_unknown_key_far_from_every_key_gets_no_guess() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(ROOT / "configs" / "tiny.yaml", ["actor.zero_stage=3"])  # torch's section: nothing near it
    assert str(info.value).endswith("actor.zero_stage: unknown key (not in the schema)")
