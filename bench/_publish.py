"""What every benchmark does with its results: one markdown text, written under bench/results/ and printed."""

from __future__ import annotations

from pathlib import Path


def publish(lines: list[str], path: Path) -> str:
    """Join ``lines`` into the results text, write it to ``path`` (creating bench/results/), print it, return it."""
    text = "\n".join(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return text
