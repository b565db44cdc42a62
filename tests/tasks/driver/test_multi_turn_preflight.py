"""Pre-flight of `rollout.multi_turn`: each bad setting is refused in one line naming its field, before
anything starts; a template that rewrites history is refused unless `new_row` is chosen.
CPU only, no Ray: `pytest tests/tasks/driver/test_multi_turn_preflight.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlstages.configs import RunConfig, load_config
from rlstages.tasks.driver.preflight import PreflightError, check_multi_turn

ROOT = Path(__file__).resolve().parents[3]
CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
DROPS_THINKING = CHAT.replace(
    "{{ m['content'] }}",
    "{{ m['content'].split('</think>')[-1] if m['role'] == 'assistant' and not loop.last else m['content'] }}",
)


def quote(template: str) -> str:
    return template.replace("'", "''").join("''")


def cfg(model_dir: Path, *extra: str, template: str = CHAT) -> RunConfig:
    return load_config(
        ROOT / "configs" / "tiny.yaml",
        [
            f"model.path={model_dir}",
            "model.provider=local",
            "data.apply_chat_template=true",
            f"data.chat_template={quote(template)}",
            "rollout.multi_turn.enabled=true",
            "rollout.multi_turn.environment={tools: [{name: calculator}]}",
            *extra,
        ],
    )


def test_a_good_multi_turn_config_passes(tiny_model_dir: Path) -> None:
    check_multi_turn(cfg(tiny_model_dir))


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["rollout.stop=[x]"], "rollout.multi_turn.enabled: rollout.stop must be empty"),
        (["data.apply_chat_template=false"], "rollout.multi_turn.enabled: needs data.apply_chat_template=true"),
        (
            ["rollout.multi_turn.environment={tools: [{name: no_such_tool}]}"],
            "rollout.multi_turn.environment.tools.0.name",
        ),
        (["rollout.multi_turn.assistant_prefill=<tool_call></s>"], "rollout.multi_turn.assistant_prefill"),
        (["rollout.multi_turn.assistant_prefill=" + "x" * 300], "rollout.multi_turn.assistant_prefill is 300 tokens"),
        (
            ["rollout.multi_turn.enabled=false", "reward.functions=[{name: tool_call_format}]"],
            "reward.functions.0.name: tool_call_format scores the tool calls of multi-turn rollouts",
        ),
    ],
)
def test_bad_multi_turn_settings_are_refused_naming_the_field(
    tiny_model_dir: Path, extra: list[str], field: str
) -> None:
    with pytest.raises(PreflightError, match=field.replace(".", r"\.").replace("[", r"\[")):
        check_multi_turn(cfg(tiny_model_dir, *extra))


def test_sglang_is_refused(tiny_model_dir: Path) -> None:
    bad = cfg(tiny_model_dir, "rollout.backend=sglang", "cluster.num_gpus=1")
    with pytest.raises(PreflightError, match="rollout.multi_turn.enabled: multi-turn rollouts run on"):
        check_multi_turn(bad)


def test_a_history_rewriting_template_is_refused_unless_new_row(tiny_model_dir: Path) -> None:
    with pytest.raises(PreflightError, match="template_not_prefix_preserving.*expected 'new_row'"):
        check_multi_turn(cfg(tiny_model_dir, template=DROPS_THINKING))
    check_multi_turn(
        cfg(tiny_model_dir, "rollout.multi_turn.template_not_prefix_preserving=new_row", template=DROPS_THINKING)
    )


def test_an_enabled_section_needs_an_environment() -> None:
    with pytest.raises(ValueError, match="need an environment"):
        load_config(ROOT / "configs" / "tiny.yaml", ["rollout.multi_turn.enabled=true"])
