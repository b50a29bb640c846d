"""The one exception type raised for bad user input."""

from __future__ import annotations

__all__ = ["IparError"]


class IparError(ValueError):
    """Bad input or an impossible configuration.

    Messages say what was given, what was expected and how to fix it.
    """
