"""The base of every config section (draftline.config and the online training's own section): strict and frozen."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Base for all config sections: unknown keys are errors, and models are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
