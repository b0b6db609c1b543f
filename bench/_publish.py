"""What every benchmark does with its results: one markdown text, stamped with the commit it was measured at,
written under bench/results/ and printed."""

from __future__ import annotations

import re
import subprocess
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The stamp line every results file carries; ``bench/update_readme.py`` reads it back.
STAMP = re.compile(r"^Measured at commit `(?P<commit>[0-9a-f]{7,40})` \((?P<tree>[^)]*)\)", re.M)


def _git(*args: str) -> str:
    # Not stripped: a porcelain status line starts with a space that is part of its two-letter code.
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def stamp() -> str:
    """``Measured at commit `<sha>` (clean tree | dirty tree: N files differ ...), <UTC time>``: the tree the
    numbers came from. Files under bench/results/ do not count as dirt (they are the output)."""
    commit = _git("rev-parse", "HEAD").strip()
    changed = [line[3:] for line in _git("status", "--porcelain").splitlines()
               if line.strip() and not line[3:].startswith("bench/results/")]
    more = ", ..." if len(changed) > 5 else ""
    tree = "clean tree" if not changed else \
        f"dirty tree: {len(changed)} files differ from it ({', '.join(changed[:5])}{more})"
    return f"Measured at commit `{commit[:12]}` ({tree}), {datetime.now(UTC):%Y-%m-%d %H:%M} UTC."


def publish(lines: list[str], path: Path) -> str:
    """Join ``lines`` and the commit stamp into the results text, write it to ``path`` (creating
    bench/results/), print it, return it. The stamp goes right under the first line (the title)."""
    text = "\n".join([*lines[:1], "", stamp(), *lines[1:]])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    return text
