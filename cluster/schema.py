"""The base of every config schema: an unknown key is an error, and an assignment is validated like a loaded value."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
