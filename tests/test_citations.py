"""No file of the repository cites the project's private notes: a user's clone does not have them. Code,
configs, tests and docs cite the paper (arXiv id, section / table / equation) or the official code."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# spelled in pieces so that this file does not match itself
NOTES = tuple(f"{name}.md" for name in ("dtn", "dyt", "params", "protocols", "design")) + ("shared" + "/",)


def citing_files() -> set[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    found = set()
    for name in listed:
        path = ROOT / name
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:  # binary files
            continue
        if any(re.search(rf"(?<![\w-]){re.escape(note)}", text) for note in NOTES):  # not ln_to_dyt.md
            found.add(name)
    return found


def test_no_file_cites_the_notes():
    assert citing_files() == set()
