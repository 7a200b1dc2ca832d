"""The README is a short user's document whose two commands are what CI and a new user run, and
the documents it links to exist: every relative link in README.md and docs/*.md names a file of
the repo and, for a Markdown file, a heading in it."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 300

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (a `# comment` in a bash block is not a heading)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def anchors(md: Path) -> set[str]:
    """The heading anchors GitHub gives a Markdown file: lower case, punctuation dropped, spaces
    as hyphens, a repeated heading numbered -1, -2, ..."""
    slugs: set[str] = set()
    count: dict[str, int] = {}
    for line in prose(md.read_text(encoding="utf-8")):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = count.get(slug, 0)
        count[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def _rel(p: Path) -> str:
    return os.path.relpath(p, REPO)


def broken_links(md: Path) -> list[str]:
    bad = []
    for line in prose(md.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):        # http:, https:, mailto:
                continue
            path, _, frag = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                bad.append(f"{_rel(md)}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in anchors(dest):
                bad.append(f"{_rel(md)}: {target} (no heading #{frag} in {_rel(dest)})")
    return bad


def test_the_readme_opens_with_the_two_commands_ci_and_a_new_user_run():
    first_block = README.read_text(encoding="utf-8").split("```")[1]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()[1:] if line.strip()]
    assert commands == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == "make test", ".ci/run must run exactly the README's test command"


def test_the_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, (f"README.md has {n} lines (at most {MAX_README_LINES}): put reference "
                                   "material in docs/<topic>.md and link it")


def test_every_document_in_docs_is_linked_from_the_readme():
    linked = {(REPO / t.partition("#")[0]).resolve() for t in LINK.findall(README.read_text(encoding="utf-8"))}
    missing = [d.name for d in DOCS if d.resolve() not in linked]
    assert not missing, f"docs not linked from README.md: {missing}"


@pytest.mark.parametrize("md", [README, *DOCS], ids=lambda p: p.name)
def test_relative_links_name_existing_files_and_headings(md):
    assert not broken_links(md), "\n".join(broken_links(md))


def test_anchors_follow_githubs_rules(tmp_path):
    md = tmp_path / "a.md"
    md.write_text("# Weight-only int8 / bf16: `precision.weights`\n## How graphmode's kernels run\n"
                  "## Notes\n## Notes\n```bash\n# not a heading\n```\n")
    assert anchors(md) >= {"weight-only-int8--bf16-precisionweights", "how-graphmodes-kernels-run",
                           "notes", "notes-1"}
    assert "not-a-heading" not in anchors(md)


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "b.md").write_text("# Here\n")
    md = tmp_path / "a.md"
    md.write_text("[ok](b.md#here) [gone](c.md) [heading](b.md#there) [web](https://example.com/x)\n")
    bad = broken_links(md)
    assert len(bad) == 2 and "c.md (no such file)" in bad[0] and "no heading #there" in bad[1]
