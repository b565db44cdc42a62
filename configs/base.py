"""The strict base model every config section derives from.

Non-goal: defaults for model or data (TRL's rule) — those must be given by the user.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A frozen pydantic model that rejects unknown keys, so a typo is an error, not a silent default."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
