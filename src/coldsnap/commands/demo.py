"""``coldsnap demo``: the main job (see coldsnap.demo)."""

from __future__ import annotations

from coldsnap.demo import register_cli as register

__all__ = ["register"]
