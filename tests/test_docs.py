"""The documentation holds together: relative links resolve, cited doc pages and sections exist,
the README stays short, and nothing points outside the repository. Plain text checks, no jax."""

import pathlib
import re
import urllib.parse

ROOT = pathlib.Path(__file__).resolve().parent.parent
README_LIMIT = 12_000  # characters

# [text](target) and ![alt](target); the text may span lines, the target may carry a "title".
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DOC_CITATION = re.compile(r"(?<![\w.-])(docs/[\w/.-]+\.md)")
# "docs/official_code.md 1.4", "... md section 4", "... md 2.3, 2.4, 5.2", "... md 1.4 and 4.4"
NUM = r"\d+(?:\.\d+)*"
SECTION_CITATION = re.compile(
    r"(?<![\w.-])(docs/[\w/.-]+\.md)[`'\"]*,?\s+(?:sections?\s+|§\s*)?"
    rf"({NUM}(?:(?:\s*,\s*|\s+and\s+){NUM})*)(?![\w.]*\w)")
NUMBERED_HEADING = re.compile(rf"^#+\s+({NUM})\.?\s", re.MULTILINE)
FORBIDDEN = ("shared/spec", "official_facts.md", "../shared")


def rel(path: pathlib.Path) -> str:
  return path.relative_to(ROOT).as_posix()


def markdown_files():
  files = [ROOT / "README.md"]
  files += sorted((ROOT / "docs").rglob("*.md"))
  files += sorted((ROOT / "research").rglob("*.md"))
  return [f for f in files if f.is_file()]


def source_files():
  files = sorted((ROOT / "decay_jax").rglob("*.py"))
  files += sorted((ROOT / "configs").glob("*.py"))
  files += sorted((ROOT / "research").rglob("*.py"))
  files += sorted((ROOT / "tests").glob("*.py"))
  files += sorted((ROOT / "launch").glob("*.sh"))
  return files


def without_code(text: str) -> str:
  """Blank out fenced code blocks (keeping the line count) and inline code: no links there."""
  out, fenced = [], False
  for line in text.split("\n"):
    if line.lstrip().startswith("```"):
      fenced = not fenced
      out.append("")
    else:
      out.append("" if fenced else re.sub(r"`[^`\n]*`", "", line))
  return "\n".join(out)


def links(path: pathlib.Path):
  text = without_code(path.read_text(encoding="utf-8"))
  for m in LINK.finditer(text):
    yield text.count("\n", 0, m.start()) + 1, m.group(1)


def is_external(target: str) -> bool:
  return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target))  # http:, https:, mailto:, ...


def resolve(path: pathlib.Path, target: str) -> pathlib.Path:
  target = urllib.parse.unquote(target.split("#", 1)[0])
  base = ROOT if target.startswith("/") else path.parent
  return (base / target.lstrip("/")).resolve()


def section_numbers(doc: pathlib.Path):
  return set(NUMBERED_HEADING.findall(doc.read_text(encoding="utf-8")))


def test_relative_links_resolve():
  bad = []
  for md in markdown_files():
    for line, target in links(md):
      if is_external(target) or target.startswith("#"):
        continue
      found = resolve(md, target)
      if not found.exists():
        bad.append(f"{rel(md)}:{line}: link to {target!r} does not resolve ({found})")
      elif ROOT not in found.parents and found != ROOT:
        bad.append(f"{rel(md)}:{line}: link to {target!r} leaves the repository")
  assert not bad, "broken links:\n" + "\n".join(bad)


def test_cited_doc_files_exist():
  bad = []
  for src in source_files():
    text = src.read_text(encoding="utf-8")
    for m in DOC_CITATION.finditer(text):
      if not (ROOT / m.group(1)).is_file():
        line = text.count("\n", 0, m.start()) + 1
        bad.append(f"{rel(src)}:{line}: cites {m.group(1)}, which does not exist")
  assert not bad, "citations of missing doc pages:\n" + "\n".join(bad)


def test_cited_sections_exist():
  """``docs/official_code.md 1.4`` needs a heading numbered 1.4 in that page (likewise for every
  page whose headings are numbered, such as docs/routing.md)."""
  bad, cache = [], {}
  for src in source_files():
    text = src.read_text(encoding="utf-8")
    for m in SECTION_CITATION.finditer(text):
      doc = ROOT / m.group(1)
      if not doc.is_file():
        continue  # reported by test_cited_doc_files_exist
      if doc not in cache:
        cache[doc] = section_numbers(doc)
      if not cache[doc]:
        continue  # a page without numbered sections: a number after its name is not a section
      line = text.count("\n", 0, m.start()) + 1
      for number in re.findall(NUM, m.group(2)):
        if number not in cache[doc]:
          bad.append(f"{rel(src)}:{line}: cites {m.group(1)} {number}, which has no such section")
  assert not bad, "citations of missing sections:\n" + "\n".join(bad)


def test_official_code_sections_are_numbered():
  numbers = section_numbers(ROOT / "docs" / "official_code.md")
  for n in ["0", "1", "2", "3", "4", "5", "6", "7", "1.4", "1.13", "2.4", "3.2", "4.8", "5.3", "6.2"]:
    assert n in numbers, f"docs/official_code.md: no heading numbered {n}"


def test_readme_is_short():
  n = len((ROOT / "README.md").read_text(encoding="utf-8"))
  assert n < README_LIMIT, f"README.md has {n} characters; keep it under {README_LIMIT} (move detail to docs/)"


def test_docs_do_not_point_outside_the_repository():
  bad = []
  for md in [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md")):
    for i, line in enumerate(md.read_text(encoding="utf-8").split("\n"), 1):
      for word in FORBIDDEN:
        if word in line:
          bad.append(f"{rel(md)}:{i}: mentions {word!r}")
  assert not bad, "references outside the repository:\n" + "\n".join(bad)
