"""What ``satp submit`` counts as its upload: Ray's documented rules for a local ``working_dir``
(the runtime environment's ``excludes``, and the ``.gitignore`` and ``.rayignore`` files of its
directories, all in gitignore syntax), read without Ray's private packaging helpers. git itself
is the reference for the syntax: the same patterns, given to ``git ls-files``, leave the same files.
"""
from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: modules that are no public API of Ray
RAY_PRIVATE = ("ray._private", "ray._raylet", "ray.core.generated", "ray.train.v2._internal")

#: gitignore's forms: at any depth or anchored, directories only, ``*``, ``?``, classes, ``**`` at the
#: start, middle and end, negation, escapes, trailing spaces, comments and blank lines
EXCLUDES = ["# a comment", "", "*.log", "!keep.log", "/top.txt", "build/", "docs/*.md", "a/**/z.txt", "**/cache",
            "deep/**", "name?.bin", "[ab]x.dat", "[!a-c]y.dat", "\\#hash", "trail   ", "sub/inner/", "\\!bang"]
NESTED = "*.tmp\n/only-here.txt\nm/\n"  # the ignore file of directory n/: its patterns are relative to n/
FILES = ["x.log", "keep.log", "d/y.log", "d/keep.log", "top.txt", "d/top.txt", "build/o.bin", "d/build/o.bin",
         "d2/build", "docs/a.md", "docs/sub/b.md", "a/z.txt", "a/b/c/z.txt", "b/a/z.txt", "cache/f", "d/cache/f",
         "d/cachex/f", "deep/f", "deep/e/f", "deepx", "name1.bin", "name12.bin", "d/nameX.bin", "ax.dat", "cx.dat",
         "by.dat", "dy.dat", "#hash", "d/#hash", "trail", "trail x", "sub/inner/f", "x/sub/inner/f", "!bang",
         "n/a.tmp", "n/k/b.tmp", "c.tmp", "n/only-here.txt", "n/k/only-here.txt", "n/m/f", "n/k/m/f", "m/f",
         "keep/me.py"]


def _tree(directory: Path, ignore_file: str) -> None:
    for rel in FILES:
        (directory / rel).parent.mkdir(parents=True, exist_ok=True)
        (directory / rel).write_text(rel)
    (directory / "n" / ignore_file).write_text(NESTED)


def _git_keeps(directory: Path, ignore_file: str) -> set[str]:
    """The files git leaves in (not ignored) with :data:`EXCLUDES` as the repository's own excludes
    and ``ignore_file`` read in every directory (git's own settings elsewhere: none)."""
    subprocess.run(["git", "init", "-q", str(directory)], check=True)
    (directory / ".git" / "info" / "exclude").write_text("\n".join(EXCLUDES) + "\n")
    out = subprocess.run(["git", "-C", str(directory), "-c", "core.excludesFile=/dev/null", "ls-files", "--others",
                          "-z", "--exclude-from=.git/info/exclude", f"--exclude-per-directory={ignore_file}"],
                         check=True, capture_output=True, text=True).stdout
    return {path for path in out.split("\0") if path}


@pytest.mark.parametrize("ignore_file", [".gitignore", ".rayignore"])
def test_the_upload_leaves_out_what_git_would_ignore(tmp_path, ignore_file):
    from pipeline.cli.submit import upload_files

    _tree(tmp_path, ignore_file)
    kept = _git_keeps(tmp_path, ignore_file)
    assert "keep.log" in kept and "x.log" not in kept and "n/k/only-here.txt" in kept  # the reference works
    assert set(upload_files(tmp_path, [".git", *EXCLUDES])) == kept


def test_ignore_files_combine_as_rays_do(tmp_path, monkeypatch):
    """Each source leaves out what it lists (a ``!`` line takes back only what its own file left
    out); ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1`` (Ray's documented switch) leaves ``.gitignore`` out."""
    from pipeline.cli.submit import upload_files

    for rel in ("a.bin", "keep.bin", "b.txt", "c.txt"):
        (tmp_path / rel).write_text(rel)
    (tmp_path / ".gitignore").write_text("*.bin\nb.txt\n")
    (tmp_path / ".rayignore").write_text("!keep.bin\nc.txt\n")
    assert set(upload_files(tmp_path, ["*.txt", "!b.txt"])) == {".gitignore", ".rayignore"}
    monkeypatch.setenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "1")
    assert set(upload_files(tmp_path, [])) == {".gitignore", ".rayignore", "a.bin", "keep.bin", "b.txt"}


def test_the_upload_counts_what_links_point_to(tmp_path):
    """Ray follows symbolic links and uploads what they point to (its runtime-environment docs)."""
    from pipeline.cli.submit import upload_files

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "big.bin").write_bytes(b"x" * 1000)
    (tmp_path / "wd").mkdir()
    (tmp_path / "wd" / "linked").symlink_to(tmp_path / "elsewhere")
    assert upload_files(tmp_path / "wd", []) == {"linked/big.bin": 1000}


def test_satp_submit_uses_only_rays_public_api():
    tree = ast.parse((ROOT / "pipeline" / "cli" / "submit.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not sorted(name for name in imported if name.startswith(RAY_PRIVATE))
