"""The git state a run records: its commit, and dirty only where the code differs (not results/)."""

import subprocess

from normexp.tracking.provenance import git_state


def test_dirty_means_the_code_differs_not_the_rendered_results(tmp_path):
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "results").mkdir()
    (tmp_path / "pkg").mkdir()
    (tmp_path / "results" / "table.md").write_text("old\n")
    (tmp_path / "pkg" / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    assert git_state(tmp_path / "pkg") == {"commit": git_state(tmp_path)["commit"], "dirty": False}
    (tmp_path / "results" / "table.md").write_text("new\n")
    assert git_state(tmp_path / "pkg")["dirty"] is False
    (tmp_path / "pkg" / "code.py").write_text("x = 2\n")
    assert git_state(tmp_path / "pkg")["dirty"] is True
