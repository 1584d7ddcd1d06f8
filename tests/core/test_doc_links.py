"""Every relative link in README.md and docs/*.md points at a file of the repository, and an anchor at one of the
target's headings (GitHub's heading ids), so moving text between documents cannot leave a link dangling."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def heading_ids(markdown: str) -> set[str]:
    """GitHub's ids of the headings of ``markdown``: lower case, punctuation but ``-`` and ``_`` dropped, spaces
    as ``-``; a repeated id gets ``-1``, ``-2``, ... Headings inside fenced code are not headings."""
    ids, seen, fenced = set(), {}, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        match = None if fenced else re.match(r"#{1,6} (.+)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            ids.add(slug if count == 0 else f"{slug}-{count}")
    return ids


def test_heading_ids_follow_github():
    text = "# VLM: ShapesQA + MotionQA\n## `mmgrpo bench learning`: the flow\n```\n# not a heading\n```\n## Data\n## Data\n"
    assert heading_ids(text) == {"vlm-shapesqa--motionqa", "mmgrpo-bench-learning-the-flow", "data", "data-1"}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document):
    broken = []
    for target in LINK.findall(document.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (document.parent / path).resolve() if path else document
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in heading_ids(file.read_text()):
            broken.append(f"{target}: no heading with id {anchor!r} in {file.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)
