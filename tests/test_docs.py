"""The documentation holds together: README.md stays a short front door, and every relative link in it
and in docs/*.md points to a file that exists (and, with a `#fragment`, to a heading of that page)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_MAX_LINES = 300

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title")
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def prose(path: Path) -> str:
    """The page's text outside fenced code blocks and inline code spans."""
    lines, fence = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped, spaces as -."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, fence, seen = set(), False, {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        match = None if fence else re.match(r"^#{1,6} (.+)", line)
        if match:
            slug = anchor(match.group(1))
            count = seen.get(slug, 0)
            found.add(slug if count == 0 else f"{slug}-{count}")
            seen[slug] = count + 1
    return found


def relative_links(path: Path) -> list[str]:
    text = prose(path)
    targets = LINK.findall(text) + IMAGE.findall(text)
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # not http:, mailto:, ...


def test_docs_exist() -> None:
    assert (ROOT / "docs" / "index.md").is_file()
    assert len(pages()) > 2


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines; keep it under {README_MAX_LINES}, in docs/ the rest"
    )


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        file, _, fragment = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(
                f"{target} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})"
            )
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: " + "; ".join(broken)


def test_every_docs_page_is_linked_from_the_index_and_the_readme() -> None:
    index = set(relative_links(ROOT / "docs" / "index.md"))
    readme = set(relative_links(README))
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name == "index.md":
            assert "docs/index.md" in {t.partition("#")[0] for t in readme}
            continue
        assert page.name in {t.partition("#")[0] for t in index}, f"docs/index.md does not link {page.name}"
        assert f"docs/{page.name}" in {t.partition("#")[0] for t in readme}, (
            f"README.md does not link docs/{page.name}"
        )
