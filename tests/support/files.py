"""Files written as the tests' writers write them."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["replace_atomically"]


def replace_atomically(path: Path, text: str) -> None:
    """Write ``path`` as editors and tools do: a new file beside it, renamed over it. A reader
    (the agent's reload loop) sees the old content or the new, never a file cut short."""
    new = path.with_name(f".{path.name}.new")
    new.write_text(text)
    os.replace(new, path)
