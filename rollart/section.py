"""The base of every config section (rollart.config and the settings modules it is made of)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: frozen, and an unknown field is an error that names it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
