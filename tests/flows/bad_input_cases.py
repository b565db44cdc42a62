"""Rows of the bad-input table (tests/flows/test_bad_inputs.py) for the config and what it names: the config file and
its overrides, what the chosen backend can do, run names, the model directory, data files, code the config names,
fault injection, existing runs, conversion, servers and comparisons. Each row: (case id, argv, environment, text the
one line must contain)."""

from __future__ import annotations

from pathlib import Path

from bad_input_workspace import LORA, TRACKING, B, M, jsonl_config

CONFIG_CASES: list[tuple[str, list[str], dict[str, str], str]] = [
    # the config file and its overrides
    ("missing-config", ["run", "nope.yaml"], {}, "nope.yaml: no such config file"),
    ("non-utf8-config", ["run", "latin1.yaml"], {}, "latin1.yaml: not UTF-8"),
    ("broken-yaml", ["run", "broken.yaml"], {}, "broken.yaml: line"),
    ("yaml-list", ["run", "list.yaml"], {}, "expected a mapping"),
    ("override-no-equals", ["run", B, "rollout.n"], {}, "expected KEY=VALUE"),
    ("override-double-dot", ["run", B, "trainer..run_name=x"], {}, "empty segment"),
    ("override-trailing-dot", ["run", B, "rollout.n.=4"], {}, "empty segment"),
    ("override-empty-key", ["run", B, "=4"], {}, "empty key"),
    ("unknown-key", ["run", B, "trainer.colour=red"], {}, "trainer.colour: unknown key"),
    ("wrong-type", ["run", B, "rollout.n=one"], {}, "rollout.n: Input should be a valid integer"),
    ("zero-steps", ["run", B, "trainer.total_steps=0"], {}, "trainer.total_steps"),
    ("grpo-n1", ["run", B, "rollout.n=1"], {}, "needs rollout.n > 1"),
    ("gae-no-critic", ["run", B, "algorithm.adv_estimator=gae"], {}, "add a `critic:` section"),
    # what the chosen backend can do (its registry entry)
    ("torch-two-ranks", ["run", B, "actor.num_workers=2"], {}, "actor.backend=torch trains in one process"),
    ("sglang-no-gpus", ["run", B, "rollout.backend=sglang"], {}, "rollout.backend=sglang needs GPUs"),
    (
        "lora-on-deepspeed",
        ["run", B, LORA % "v_proj", "actor.backend=deepspeed"],
        {},
        "model.lora trains adapters on the torch backend only; got actor.backend=deepspeed",
    ),
    (
        "megatron-cp-without-te",
        ["run", B, "actor.backend=megatron", "actor.num_workers=2", "actor.context_parallel_size=2"],
        {},
        "actor.context_parallel_size=2: megatron-core splits attention over CP ranks only with Transformer Engine",
    ),
    (
        "megatron-ep-dense-model",
        ["run", B, "actor.backend=megatron", "actor.num_workers=2", "actor.expert_model_parallel_size=2"],
        {},
        "actor.expert_model_parallel_size=2: the model is dense",
    ),
    (
        "megatron-etp-over-tp",
        ["run", B, "actor.backend=megatron", "actor.num_workers=2", "actor.expert_tensor_parallel_size=2"],
        {},
        "expert_tensor_parallel_size=2 must divide tensor_model_parallel_size=1",
    ),
    (
        "megatron-router-topk-over-experts",
        ["run", B, "actor.backend=megatron", "model.provider=tiny-random"]
        + ["model.tiny={model_type: qwen3_moe, num_experts: 4}", "actor.moe={router_topk: 8}"],
        {},
        "actor.moe.router_topk=8 is larger than the model's 4 routed experts; use at most 4",
    ),
    (
        "expert-parallel-on-torch",
        ["run", B, "actor.expert_model_parallel_size=2"],
        {},
        "actor.expert_model_parallel_size: expert parallelism needs actor.backend=megatron",
    ),
    (
        "tensor-parallel-on-deepspeed",
        ["run", B, "actor.backend=deepspeed", "actor.tensor_model_parallel_size=2"],
        {},
        "actor.tensor_model_parallel_size: tensor parallelism needs actor.backend=megatron",
    ),
    ("async-field-without-mode", ["run", B, "trainer.async.max_staleness=2"], {}, "set trainer.mode: async"),
    (
        "async-on-hybrid-engine",
        ["run", B, "trainer.mode=async", "cluster.hybrid_engine=true"],
        {},
        "trainer.mode=async overlaps generation with the update",
    ),
    (
        "async-kv-keep-without-partial",
        ["run", B, "trainer.mode=async", "cluster.hybrid_engine=false", "trainer.async.kv_on_update=keep"],
        {},
        "trainer.async.kv_on_update=keep only matters with partial_rollout: true",
    ),
    (
        "async-kv-keep-on-vllm",
        [
            "run",
            B,
            "trainer.mode=async",
            "cluster.hybrid_engine=false",
            "trainer.async.partial_rollout=true",
            "trainer.async.kv_on_update=keep",
            "rollout.backend=vllm",
        ],
        {},
        "trainer.async.kv_on_update=keep: rollout.backend=vllm continues an interrupted sequence by prefilling",
    ),  # fmt: skip
    (
        "async-queue-below-a-step",
        ["run", B, "trainer.mode=async", "cluster.hybrid_engine=false", "trainer.async.queue_capacity=1"],
        {},
        "trainer.async.queue_capacity=1 is smaller than one step's",
    ),
    (
        "async-replay-without-schedule",
        ["run", B, "trainer.mode=async", "cluster.hybrid_engine=false", "trainer.async.replay=nope/schedule.jsonl"],
        {},
        "nope/schedule.jsonl: no schedule file (only runs with trainer.mode: async record one)",
    ),
    ("micro-batch", ["run", B, "actor.micro_batch_size=5"], {}, "actor.micro_batch_size=5 must divide"),
    ("resume-mode", ["run", B, "checkpoint.resume=sometimes"], {}, "checkpoint.resume"),
    ("on-corrupt", ["run", B, "checkpoint.on_corrupt=maybe"], {}, "checkpoint.on_corrupt"),
    ("on-nonfinite", ["run", B, "trainer.on_nonfinite=ignore"], {}, "trainer.on_nonfinite"),
    ("overlong-policy", ["run", B, "data.overlong_prompts=cut"], {}, "data.overlong_prompts"),
    ("no-rewards", ["run", B, "reward.functions=[]"], {}, "reward.functions"),
    ("sglang-on-cpu", ["run", B, "rollout.backend=sglang"], {}, "rollout.backend=sglang needs GPUs"),
    (
        "python-tool-not-isolable",  # bubblewrap asked for, and not on PATH: refused, not run weaker
        [
            "run",
            B,
            "rollout.multi_turn={enabled: true, environment: {tools: [{name: python, kwargs: "
            "{isolation_backend: bwrap}}]}}",
        ],
        {"PATH": "/nonexistent"},
        "rollout.multi_turn.environment.tools.0.kwargs.require_isolation: this machine cannot isolate the python "
        "tool: bwrap not found",
    ),
    # run names (schema: `config show` refuses them too)
    ("name-dotdot", ["run", B, "trainer.run_name=.."], {}, "trainer.run_name: '..' is not a run name"),
    ("name-dot", ["run", B, "trainer.run_name=a.b"], {}, "trainer.run_name: 'a.b' is not a run name"),
    ("name-slash", ["run", B, "trainer.run_name=a/b"], {}, "trainer.run_name: 'a/b' is not a run name"),
    ("name-up", ["run", B, "trainer.run_name=../done"], {}, "trainer.run_name"),
    ("name-empty", ["run", B, "trainer.run_name="], {}, "trainer.run_name: '' is not a run name"),
    ("name-space", ["run", B, "trainer.run_name=a b"], {}, "trainer.run_name"),
    ("name-long", ["run", B, "trainer.run_name=" + "x" * 101], {}, "trainer.run_name"),
    ("show-name-dotdot", ["config", "show", B, "trainer.run_name=.."], {}, "trainer.run_name"),
    ("show-name-empty", ["config", "show", B, "trainer.run_name="], {}, "trainer.run_name"),
    # the model directory
    ("model-missing", ["run", B, "model.path=models/none"], {}, "model.path: models/none does not exist"),
    ("model-is-file", ["run", B, "model.path=models/a-file.bin"], {}, "a-file.bin is not a directory"),
    ("model-no-config", ["run", B, f"model.path={M}/no-config"], {}, "no-config/config.json is missing"),
    ("model-bad-json", ["run", B, f"model.path={M}/bad-json"], {}, "bad-json/config.json is not valid JSON"),
    ("model-list-json", ["run", B, f"model.path={M}/list-json"], {}, "list-json/config.json is not an HF config"),
    ("model-no-weights", ["run", B, f"model.path={M}/no-weights"], {}, "no-weights has no *.safetensors"),
    ("model-truncated", ["run", B, f"model.path={M}/truncated"], {}, "is truncated"),
    ("model-garbage", ["run", B, f"model.path={M}/garbage"], {}, "is not a readable safetensors file"),
    ("model-index", ["run", B, f"model.path={M}/bad-index"], {}, "model-00002-of-00002.safetensors is named"),
    ("reward-model", ["run", B, "reward.reward_model={path: models/none}"], {}, "reward.reward_model.path"),
    # data files
    ("data-missing", ["run", B, jsonl_config(Path("data/none.jsonl"))], {}, "data.source.train_path"),
    ("data-empty", ["run", B, jsonl_config(Path("data/empty.jsonl"))], {}, "empty.jsonl has no rows"),
    ("data-latin1", ["run", B, jsonl_config(Path("data/latin1.jsonl"))], {}, "latin1.jsonl is not UTF-8"),
    ("data-broken", ["run", B, jsonl_config(Path("data/broken.jsonl"))], {}, "broken.jsonl:2 is not JSON"),
    ("data-no-answer", ["run", B, jsonl_config(Path("data/noanswer.jsonl"))], {}, "noanswer.jsonl:1 lacks 'answer'"),
    ("data-not-object", ["run", B, jsonl_config(Path("data/list.jsonl"))], {}, "list.jsonl:1 lacks"),
    ("data-key", ["run", B, jsonl_config(Path("data/good.jsonl"), prompt_key="question")], {}, "lacks 'question'"),
    (
        "data-eval-missing",
        ["run", B, jsonl_config(Path("data/good.jsonl"), eval_path="data/none.jsonl")],
        {},
        "data.source.eval_path",
    ),
    ("prompt-too-long", ["run", B, jsonl_config(Path("data/long.jsonl"))], {}, "prompt(s) longer than 504 tokens"),
    ("no-room", ["run", B, "rollout.max_new_tokens=600"], {}, "rollout.max_new_tokens: 600 leaves no room"),
    # code the config names
    ("reward-unknown", ["run", B, "reward.functions=[{name: nope}]"], {}, "unknown reward function 'nope'"),
    ("reward-module", ["run", B, "reward.functions=[{name: 'no_such_mod:f'}]"], {}, "cannot import module"),
    ("reward-attr", ["run", B, "reward.functions=[{name: 'json:nope'}]"], {}, "has no attribute 'nope'"),
    ("reward-not-callable", ["run", B, "reward.functions=[{name: 'os:sep'}]"], {}, "is not callable"),
    ("reward-malformed", ["run", B, "reward.functions=[{name: ':f'}]"], {}, "expected 'package.module:function'"),
    ("plugin-missing", ["run", B, "model.plugins=[no_such_plugin]"], {}, "model.plugins.0"),
    # fault injection spec
    ("faults-garbage", ["run", B], {"RLSTAGES_FAULTS": "garbage"}, "RLSTAGES_FAULTS: 'garbage'"),
    ("faults-step", ["run", B], {"RLSTAGES_FAULTS": "generate@x:fatal"}, "RLSTAGES_FAULTS"),
    ("faults-stage", ["run", B], {"RLSTAGES_FAULTS": "nostage@1:fatal"}, "unknown stage 'nostage'"),
    ("faults-kind", ["run", B], {"RLSTAGES_FAULTS": "generate@1:explode"}, "unknown kind 'explode'"),
    # existing runs: never overwritten by another config, damaged ones said loudly
    ("other-config", ["run", B, "trainer.run_name=done", "rollout.n=8"], {}, "holds a run of another config"),
    ("other-actor-backend", ["run", B, "trainer.run_name=done", "actor.backend=megatron"], {}, "another config"),
    ("other-rollout-backend", ["run", B, "trainer.run_name=done", "rollout.backend=vllm"], {}, "another config"),
    ("resume-never", ["run", B, "trainer.run_name=done", "checkpoint.resume=never"], {}, "already holds a run"),
    ("output-is-file", ["run", B, "trainer.output_dir=a-file"], {}, "trainer.output_dir: a-file exists"),
    ("run-corrupt", ["run", B, "trainer.run_name=corrupt"], {}, "actor/model.safetensors does not match its sha256"),
    ("resume-not-a-run", ["resume", "foreign"], {}, "foreign: not a run directory"),
    ("resume-corrupt", ["resume", "runs/corrupt"], {}, "step_000002: actor/model.safetensors does not match"),
    ("resume-bad-manifest", ["resume", "runs/badmanifest"], {}, "step_000002: manifest.json is unreadable"),
    ("resume-bad-state", ["resume", "runs/badstate"], {}, "run_state.json: damaged run-state file"),
    ("eval-not-a-run", ["eval", "foreign"], {}, "foreign: not a run directory"),
    ("eval-corrupt", ["eval", "runs/corrupt"], {}, "does not match its sha256"),
    ("eval-no-checkpoint", ["eval", "runs/empty"], {}, "runs/empty: no committed checkpoint"),
    ("eval-ckpt-missing", ["eval", "runs/done", "--checkpoint", "runs/done/nope"], {}, "nope: no such directory"),
    (
        "eval-ckpt-uncommitted",
        ["eval", "runs/uncommitted", "--checkpoint", "runs/uncommitted/checkpoints/step_000002"],
        {},
        "no manifest.json; not a committed checkpoint",
    ),
    (
        "eval-ckpt-corrupt",
        ["eval", "runs/done", "--checkpoint", "runs/corrupt/checkpoints/step_000002"],
        {},
        "does not match its sha256",
    ),
    (
        "eval-ckpt-other-config",
        ["eval", "runs/done", "--checkpoint", "other/checkpoints/step_000003"],
        {},
        "a checkpoint of another config",
    ),
    # conversion
    ("convert-missing", ["convert", "models/none", "out"], {}, "models/none: HF model directory not found"),
    ("convert-markup", ["convert", "a[/]b", "out"], {}, "a[/]b: HF model directory not found"),
    (
        "convert-into-checkpoint",
        ["convert", "MODEL", "runs/done/checkpoints/step_000002"],
        {},
        "step_000002: exists and is not an rlstages conversion output",
    ),
    ("convert-into-foreign", ["convert", "MODEL", "foreign"], {}, "foreign: exists and is not an rlstages conversion"),
    ("convert-into-file", ["convert", "MODEL", "a-file"], {}, "a-file: exists and is not a directory"),
    (
        "convert-uneven-stages",
        ["convert", "MODEL", "out", "--pp", "2", "--first-stage-layers", "5"],
        {},
        "uneven pipeline stages: 2 layers minus first=5",
    ),
    ("export-not-converted", ["export", "foreign", "out"], {}, "foreign is not a complete conversion output"),
    # servers and comparisons
    ("server-status-broken", ["server", "status"], {}, "servers.json: damaged server state file"),
    ("server-down-broken", ["server", "down"], {}, "servers.json: damaged server state file"),
    ("compare-no-db", ["compare", "--tracking-uri", "sqlite:///nope.db"], {}, "no such database file nope.db"),
    ("compare-no-store", ["compare", "--tracking-uri", "missing-store"], {}, "no such MLflow store directory"),
    ("compare-store-file", ["compare", "--tracking-uri", "mlruns-file"], {}, "no such MLflow store directory"),
    ("compare-experiment", ["compare", "nope", "--tracking-uri", TRACKING], {}, "no experiment 'nope'"),
    (
        "compare-metric",
        ["compare", "rlstages-tiny", "--tracking-uri", TRACKING, "--metric", "reward/nope"],
        {},
        "--metric 'reward/nope'",
    ),
]
