"""A user's model module: a custom PreTrainedModel registered under its own model_type (used by the tests)."""

from transformers import Qwen2Config, Qwen2ForCausalLM

from rlstages.engines.models import register_model


class ScaledQwen2Config(Qwen2Config):
    """Qwen2 with a logit scale: a stand-in for an architecture transformers does not ship."""

    model_type = "scaled_qwen2"

    def __init__(self, logit_scale: float = 0.5, **kwargs):
        self.logit_scale = logit_scale
        super().__init__(**kwargs)


class ScaledQwen2ForCausalLM(Qwen2ForCausalLM):
    """Multiplies the logits by `config.logit_scale`."""

    config_class = ScaledQwen2Config

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * self.config.logit_scale
        return out


register_model("scaled_qwen2", ScaledQwen2ForCausalLM, ScaledQwen2Config)
