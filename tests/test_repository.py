"""The checkout stays small: a GPU machine takes a working tree of at most 64 MiB, and real drafts are
committed beside the demo pair, so the tracked files must weigh under 50 MB."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT_BYTES = 50_000_000


def tracked_files() -> list[Path]:
    """The files git tracks in the checkout holding these tests (skips outside a git checkout)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    top = subprocess.run(
        ["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"the tests do not run in a git checkout ({ROOT} is not a repository's root)")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in listed.decode().split("\0") if name]


def test_tracked_files_weigh_under_50_mb() -> None:
    sizes = {}
    for path in tracked_files():
        if path.is_file() and not path.is_symlink():  # a file deleted but not yet staged weighs nothing
            sizes[path.relative_to(ROOT).as_posix()] = path.stat().st_size
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda item: item[1], reverse=True)[:10]
    listing = "\n".join(f"  {size / 1e6:8.2f} MB  {name}" for name, size in largest)
    assert total < LIMIT_BYTES, (
        f"the {len(sizes)} tracked files weigh {total / 1e6:.2f} MB, over {LIMIT_BYTES / 1e6:.0f} MB; "
        f"the largest:\n{listing}"
    )
