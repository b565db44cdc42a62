"""Pre-flight checks of the config and what it names: the run name, fault drills, the model directories, the
modules it imports (allowed by a deployment, then importable), the tracking store, LoRA targets, multi-turn
tools and templates, context parallelism, the backends' packages, the run directory."""

from __future__ import annotations

import importlib.util
import warnings
from typing import get_args

from rlstages.configs import RunConfig
from rlstages.configs.stages import StageName
from rlstages.configs.trainer import RUN_NAME
from rlstages.engines.imports import allowed_imports, check_allowed
from rlstages.engines.model_files import check_model_dir
from rlstages.engines.registry import ROLLOUT_BACKENDS, TRAINING_BACKENDS, rollout_backend, training_backend
from rlstages.engines.sync.registry import choose_transport
from rlstages.tasks.driver.checks import PreflightError


def check_backends(cfg: RunConfig) -> None:
    """What the chosen backends can do (their registry entries) against what the config asks of them: LoRA, more
    than one rank, a machine without GPUs, the weight transport the layout picks."""
    able = {name for name, entry in TRAINING_BACKENDS.items() if entry.lora}
    if cfg.model.lora is not None and not training_backend(cfg.actor.backend).lora:
        raise PreflightError(
            f"model.lora trains adapters on the {' or '.join(sorted(able))} backend only; got actor.backend="
            f"{cfg.actor.backend} (use actor.backend: {sorted(able)[0]}, or remove model.lora)"
        )
    for role, train in (("actor", cfg.actor), ("critic", cfg.critic)):
        if train is not None and train.num_workers != 1 and not training_backend(train.backend).data_parallel:
            able = {name for name, entry in TRAINING_BACKENDS.items() if entry.data_parallel}
            raise PreflightError(
                f"{role}.backend={train.backend} trains in one process (num_workers must be 1, got "
                f"{train.num_workers}); for data parallelism use backend {' or '.join(sorted(able))}"
            )
    rollout = rollout_backend(cfg.rollout.backend)
    if rollout.needs_gpu and cfg.cluster.num_gpus == 0:
        raise PreflightError(
            f"rollout.backend={cfg.rollout.backend} needs GPUs (cluster.num_gpus=0); it has no CPU build"
        )
    if cfg.trainer.mode == "async" and cfg.trainer.async_.partial_rollout and not rollout.partial_rollout:
        streaming = sorted(name for name, entry in ROLLOUT_BACKENDS.items() if entry.partial_rollout)
        raise PreflightError(
            "trainer.async.partial_rollout: continuing sequences across a weight update needs a streaming engine, "
            f"which rollout.backend={cfg.rollout.backend} does not have"
            + (f" (use rollout.backend: {' or '.join(streaming)})" if streaming else " in this build")
            + "; or set partial_rollout: false"
        )
    if cfg.trainer.mode == "async" and cfg.trainer.async_.kv_on_update == "keep" and not rollout.keeps_kv:
        keeping = sorted(name for name, entry in ROLLOUT_BACKENDS.items() if entry.keeps_kv)
        raise PreflightError(
            f"trainer.async.kv_on_update=keep: rollout.backend={cfg.rollout.backend} continues an interrupted "
            "sequence by prefilling its prefix under the new weights, it keeps no KV across an update; set "
            f"kv_on_update: recompute (keep needs rollout.backend: {' or '.join(keeping)})"
        )
    placement = "hybrid" if cfg.cluster.hybrid_engine else "split"
    transport = choose_transport(placement, cfg.cluster.mode, cfg.cluster.weight_sync)
    if transport not in rollout.transports:
        raise PreflightError(
            f"cluster.weight_sync={cfg.cluster.weight_sync}: this layout sends weights by {transport}, which "
            f"rollout.backend={cfg.rollout.backend} does not receive (it takes {', '.join(sorted(rollout.transports))})"
        )


def check_context_parallel(cfg: RunConfig) -> None:
    """Megatron context parallelism needs Transformer Engine's attention (megatron-core's local attention
    asserts CP = 1): refused here, before any worker starts, where transformer_engine is not installed."""
    for role, train in (("actor", cfg.actor), ("critic", cfg.critic)):
        if train is None:
            continue
        cp = train.cp_size
        if cp > 1 and not training_backend(train.backend).context_parallel:
            raise PreflightError(f"{role}.context_parallel_size={cp}: {role}.backend does not split sequences; use 1")
        if cp > 1 and importlib.util.find_spec("transformer_engine") is None:
            raise PreflightError(
                f"{role}.context_parallel_size={cp}: megatron-core splits attention over CP ranks only with "
                "Transformer Engine, which is not installed; use 1 or install transformer_engine"
            )


def check_run_name(cfg: RunConfig) -> None:
    """The run directory is a plain child of trainer.output_dir (never `..`, a path, or a file in the way)."""
    name = cfg.trainer.run_name
    if name is not None and not RUN_NAME.fullmatch(name):
        raise PreflightError(f"trainer.run_name: {name!r} is not a run name (letters, digits, '_' and '-')")
    out = cfg.trainer.output_dir
    if out.exists() and not out.is_dir():
        raise PreflightError(f"trainer.output_dir: {out} exists and is not a directory")
    if name is not None and (out / name).exists() and not (out / name).is_dir():
        raise PreflightError(f"trainer.run_name: {out / name} exists and is not a run directory")


def check_faults(cfg: RunConfig | None = None) -> None:
    """`RLSTAGES_FAULTS` parses and names known stages and kinds."""
    from rlstages.tasks.driver.faults import parse_faults

    try:
        parse_faults(stages=get_args(StageName))
    except ValueError as exc:
        raise PreflightError(str(exc)) from None


def check_replay(cfg: RunConfig) -> None:
    """`trainer.async.replay` (set by `rlstages replay`): a whole schedule of a run with this step's shape."""
    path = cfg.trainer.async_.replay
    if path is None:
        return
    from rlstages.tasks.driver.async_schedule import read_schedule

    head = read_schedule(path)[0]
    if (head["groups_per_step"], head["n"]) != (cfg.data.prompts_per_step, cfg.rollout.n):
        raise PreflightError(
            f"trainer.async.replay: {path} records {head['groups_per_step']} prompts x {head['n']} samples a step, "
            f"this config {cfg.data.prompts_per_step} x {cfg.rollout.n}: replay the run with its own config"
        )


def check_models(cfg: RunConfig) -> None:
    """The policy's directory (a provider may build it on first use) and the reward model's."""
    try:  # the files' check is the reward model engine's too (`engines.model_files`)
        check_model_dir(cfg.model.path, "model.path", required=cfg.model.provider == "local")
        if cfg.reward.reward_model is not None:
            check_model_dir(cfg.reward.reward_model.path, "reward.reward_model.path", required=True)
    except (ValueError, OSError) as exc:
        raise PreflightError(str(exc)) from None


def import_targets(cfg: RunConfig) -> list[tuple[str, str]]:
    """(field, module) of every module the config asks workers to import."""
    out = [(f"reward.functions.{i}.name", f.name.partition(":")[0]) for i, f in enumerate(cfg.reward.functions)]
    out = [(field, module) for (field, module), f in zip(out, cfg.reward.functions, strict=True) if ":" in f.name]
    out += [(f"model.plugins.{i}", name) for i, name in enumerate(cfg.model.plugins)]
    environment = cfg.rollout.multi_turn.environment
    if cfg.rollout.multi_turn.enabled and environment is not None:
        from rlstages.engines.tools.registry import import_targets as environment_targets

        out += environment_targets(environment, "rollout.multi_turn.environment")
    return out


def check_import_allowed(cfg: RunConfig) -> None:
    """In a deployment, every module the run's parameters name must be on the deploy-time allow-list."""
    try:
        check_allowed(import_targets(cfg), allowed_imports())  # the one allow-list rule (`engines.imports`)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None


def check_imports(cfg: RunConfig) -> None:
    """Allowed, then importable: reward functions resolve to callables, plugins import."""
    check_import_allowed(cfg)
    from rlstages.engines.rewards.registry import REWARD_FUNCTIONS, resolve_reward_fn

    for i, fn in enumerate(cfg.reward.functions):
        if ":" not in fn.name and fn.name in REWARD_FUNCTIONS:
            continue  # built-in: its module ships with us
        try:
            resolve_reward_fn(fn.name, f"reward.functions.{i}.name")
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
    for i, name in enumerate(cfg.model.plugins):
        try:
            found = importlib.util.find_spec(name)
        except (ImportError, ValueError) as exc:
            found, detail = None, str(exc)
        else:
            detail = "not found"
        if found is None:
            raise PreflightError(f"model.plugins.{i}: cannot import module {name!r} ({detail})")


def check_tracking_store(cfg: RunConfig) -> None:
    """The tracking URI (`tracking.tracking_uri`, else MLFLOW_TRACKING_URI, else the default) names a store
    MLflow can open: a known scheme, a database path that exists or can be created, a driver that imports.
    Nothing is opened for writing: a store that does not exist yet is created by the run, not here."""
    from rlstages.tasks.driver.tracking import store_problem, tracking_uri_origin

    origin, uri = tracking_uri_origin(cfg)
    problem = store_problem(uri)
    if problem is not None:
        raise PreflightError(f"{origin}: {uri} {problem}")


def check_lora_targets(cfg: RunConfig) -> list[str] | None:
    """`model.lora.target_modules` are linear layers of the model: the PEFT wrapper is built on the meta device
    (no memory, no weights) from the model's config -- config.json, the tiny spec, or the provider's
    architecture -- exactly as the actor's worker will build it."""
    lora = cfg.model.lora
    if lora is None:
        return None
    from rlstages.engines.models import import_plugins, meta_causal_lm, planned_config
    from rlstages.engines.models.lora import wrap_lora

    if cfg.model.plugins:  # custom model types register themselves (allowed and importable: checked above)
        import_plugins(",".join(cfg.model.plugins))
    tiny = cfg.model.tiny.model_dump() if cfg.model.tiny is not None else None
    try:
        config = planned_config(cfg.model.path, cfg.model.provider, tiny)
        model = meta_causal_lm(config, cfg.model.model_type) if config is not None else None
    except Exception as exc:  # noqa: BLE001 - a model we cannot rehearse is left to the worker, said once
        detail = (str(exc).strip().splitlines() or [""])[0][:200]
        return [f"model.lora.target_modules: not checked before the start ({type(exc).__name__}: {detail})"]
    if model is None:
        return None  # a hub id or a model built on first use by a provider of unknown architecture
    try:
        with warnings.catch_warnings():  # transformers' deprecation notes are the worker's business
            warnings.simplefilter("ignore")
            wrap_lora(model, lora.model_dump())
    except ValueError as exc:
        raise PreflightError(str(exc).replace("model.lora.target_modules ", "model.lora.target_modules: ", 1)) from None
    return None


def check_multi_turn(cfg: RunConfig) -> None:
    """`rollout.multi_turn`: a backend that runs it, a chat template, no stop strings (turns end at EOS), an
    environment whose classes import, and, once the model exists, a prefix-preserving template or `new_row` and
    an assistant prefill that fits; `tool_call_format` only with multi-turn rollouts."""
    mt = cfg.rollout.multi_turn
    field = "rollout.multi_turn"
    if not mt.enabled:
        for i, fn in enumerate(cfg.reward.functions):
            if fn.name == "tool_call_format":
                raise PreflightError(
                    f"reward.functions.{i}.name: tool_call_format scores the tool calls of multi-turn rollouts; "
                    f"expected {field}.enabled=true"
                )
        return
    if not rollout_backend(cfg.rollout.backend).multi_turn:
        able = sorted(name for name, entry in ROLLOUT_BACKENDS.items() if entry.multi_turn)
        raise PreflightError(
            f"{field}.enabled: multi-turn rollouts run on rollout.backend {' or '.join(able)}, "
            f"not {cfg.rollout.backend!r}"
        )
    if cfg.rollout.stop:
        raise PreflightError(f"{field}.enabled: rollout.stop must be empty (a policy turn ends at its EOS token)")
    if not cfg.data.apply_chat_template:
        raise PreflightError(f"{field}.enabled: needs data.apply_chat_template=true (turns are chat messages)")
    if mt.environment is not None:
        from rlstages.engines.tools import check_environment_spec

        try:
            check_environment_spec(mt.environment, allowed_imports(), f"{field}.environment")
        except ValueError as exc:
            raise PreflightError(str(exc)) from None
    check_multi_turn_template(cfg)


def check_tool_isolation(cfg: RunConfig) -> list[str] | None:
    """Each `python` tool of a multi-turn run: reports which isolation layers this machine provides (the
    rollout workers check again on their own machines); refuses one that requires isolation (the default)
    where a layer is missing; reports one whose config says `require_isolation: false`."""
    mt = cfg.rollout.multi_turn
    if not mt.enabled or mt.environment is None or mt.environment.environment != "default":
        return None
    from rlstages.engines.tools.isolation import probe_now

    notes = []
    for i, tool in enumerate(mt.environment.tools):
        if tool.name != "python":
            continue
        field = f"rollout.multi_turn.environment.tools.{i}.kwargs.require_isolation"
        if tool.kwargs.get("require_isolation", True) is False:
            notes.append(
                f"{field}=false: the python tool runs programs without file-system isolation, seccomp "
                "or a non-root identity (network and PID namespaces and rlimits only)"
            )
            continue
        found = probe_now(tool.kwargs.get("python"), tool.kwargs.get("isolation_backend", "auto"))
        if found["missing"] is not None:
            raise PreflightError(
                f"{field}: this machine cannot isolate the python tool: {found['missing']}; "
                "run `make sandbox-env` (as root) or set it to false"
            )
        layers = "; ".join(f"{k}: {v}" for k, v in found["layers"].items())
        notes.append(f"python tool isolation on this machine: {layers}")
    return notes


def check_multi_turn_template(cfg: RunConfig) -> None:
    """The model's chat template (or data.chat_template) exists and is prefix-preserving, or `new_row` is set
    (checked once the model directory exists; a provider's model is checked by the engine at start-up)."""
    path = cfg.model.path
    if not (path / "tokenizer_config.json").is_file():
        return
    from transformers import AutoTokenizer

    from rlstages.engines.rollout.chat_render import ChatRenderer, TemplateError
    from rlstages.engines.rollout.multi_turn import prefill_ids

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    if cfg.data.chat_template:
        tokenizer.chat_template = cfg.data.chat_template
    eos = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    mt = cfg.rollout.multi_turn
    try:
        renderer = ChatRenderer(tokenizer, eos, cfg.data.system_prompt)
        preserving = renderer.prefix_preserving()
    except TemplateError as exc:
        raise PreflightError(f"rollout.multi_turn.enabled: {exc}") from None
    try:
        prefill_ids(renderer, mt.assistant_prefill, eos, mt.max_response_tokens)
    except ValueError as exc:
        raise PreflightError(str(exc)) from None
    if not preserving and mt.template_not_prefix_preserving == "refuse":
        raise PreflightError(
            "rollout.multi_turn.template_not_prefix_preserving: the chat template of "
            f"{path} rewrites earlier turns; expected 'new_row' to train on it (a new row per turn)"
        )


def check_run_dir(cfg: RunConfig) -> list[str] | None:
    """The run directory: one of another config is refused unless it holds nothing committed (then the run
    starts over in it, said as a warning); a continued run's newest checkpoint must be intact."""
    if cfg.checkpoint.resume == "fresh":
        return None  # a new directory per flow run
    from rlstages.tasks.driver.run_dir import resolve_run_dir, starts_over

    path = resolve_run_dir(cfg)
    if starts_over(cfg, path):
        return [f"{path} holds a run that committed nothing (no checkpoint, no final policy); it starts over there"]
    if (path / "config.yaml").is_file():  # the run continues: its newest checkpoint must be sound
        from rlstages.tasks.driver.checkpoints import latest_checkpoint
        from rlstages.tasks.driver.context import RunHandle

        latest_checkpoint(RunHandle(path.name, str(path)), verify=True, on_corrupt=cfg.checkpoint.on_corrupt)
    return None


def check_backend_packages(cfg: RunConfig) -> None:
    """Every chosen backend's package is installed here (when the workers run here)."""
    from rlstages.tasks.driver.workers import missing_backend_package

    problem = missing_backend_package(cfg)
    if problem:
        raise PreflightError(problem)


def check_freeze(cfg: RunConfig) -> None:
    """`actor.freeze` / `critic.freeze` name parts the model has: a text model has no vision_tower or projector
    (freezing them would freeze nothing), and freezing every part would train nothing."""
    from rlstages.engines.models.vision import COMPONENTS, VISION_MODEL_TYPES
    from rlstages.tasks.driver.data.vision import planned_model_type

    roles = [("actor", cfg.actor), *([("critic", cfg.critic)] if cfg.critic is not None else [])]
    asked = [(role, tuple(getattr(train, "freeze", ()))) for role, train in roles]
    if not any(freeze for _, freeze in asked):
        return
    kind = planned_model_type(cfg)
    if kind is None:
        return  # not known before the model exists (a hub id)
    parts = COMPONENTS if kind in VISION_MODEL_TYPES else ("language_model",)
    for role, freeze in asked:
        missing = [p for p in freeze if p not in parts]
        if missing:
            raise PreflightError(
                f"{role}.freeze: {missing} are not parts of model.path {cfg.model.path} (a {kind} model, text only: "
                f"it is all language_model); freeze vision_tower / projector on a vision-language model only"
            )
        if set(parts) <= set(freeze):
            raise PreflightError(
                f"{role}.freeze: {list(freeze)} freezes every part of the {kind} model: nothing trains"
            )


def check_profile(cfg: RunConfig) -> None:
    """`trainer.profile.steps` are steps the run has (a later one would profile nothing, silently)."""
    late = [s for s in cfg.trainer.profile.steps if s > cfg.trainer.total_steps]
    if late:
        raise PreflightError(
            f"trainer.profile.steps: {late} beyond trainer.total_steps={cfg.trainer.total_steps}; those steps never "
            "run (expected steps 1..total_steps)"
        )
