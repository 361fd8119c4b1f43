"""The documentation holds together: every relative link in README.md and docs/*.md resolves (a
`#fragment` to a markdown file names one of its headings, by GitHub's slugs), every `config.pbtxt`
parameter of templates/llm/config.pbtxt is documented exactly once, in docs/configuration.md, and
in no second parameter table elsewhere, and the README stays a short front door that links every
docs page. Plain text parsing: no server, no torch."""
import dataclasses
import re
from pathlib import Path

from backend.core.config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
CONFIGURATION = DOCS / "configuration.md"
TEMPLATE = ROOT / "templates" / "llm" / "config.pbtxt"
README_MAX_LINES = 170

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
LINK = re.compile(r"!?\[([^\]]*)\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(text: str):
    """(line number, line) of every line outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text without markup, lower case, every character but
    letters, digits, `_`, `-` and spaces dropped, each space a `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path):
    """(line number, target) of every link outside code (fenced blocks and inline code spans)."""
    for n, line in prose_lines(path.read_text(encoding="utf-8")):
        line = INLINE_CODE.sub(lambda m: "x" * len(m.group(0)), line)
        for m in LINK.finditer(line):
            yield n, m.group(2)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for n, target in links(path):
        if SCHEME.match(target):  # http:, https:, mailto: ...
            continue
        file_part, _, fragment = target.partition("#")
        where = f"{path.relative_to(root)}:{n}: {target}"
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{where} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{where} (no heading with that anchor in {dest.relative_to(root)})")
    return broken


def template_keys() -> list[str]:
    return re.findall(r'^parameters \{ key: "(\w+)"', TEMPLATE.read_text(encoding="utf-8"), re.M)


def table_rows(text: str):
    """(line number, header cells, row cells) of every body row of every markdown table."""
    header = None
    rows = []
    previous = None
    for n, line in prose_lines(text):
        if not line.lstrip().startswith("|"):
            header, previous = None, None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None and previous is not None and all(re.fullmatch(r":?-{3,}:?", c) for c in cells if c):
            header = previous
        elif header is not None:
            rows.append((n, header, cells))
        previous = cells
    return rows


def keys_of_cell(cell: str, keys: set[str]) -> set[str]:
    """The config keys a first cell names, when it is nothing but backticked config keys."""
    names = re.findall(r"`([^`]+)`", cell)
    if names and all(name in keys for name in names) and not re.sub(r"`[^`]+`|[,\s]|and", "", cell):
        return set(names)
    return set()


def test_every_relative_link_resolves():
    files = markdown_files()
    assert len(files) > 10
    broken = [b for path in files for b in broken_links(path)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_checker_sees_broken_links_and_anchors(tmp_path):
    """The checker itself: a missing file, a missing heading and a same-page anchor."""
    (tmp_path / "b.md").write_text("# Title\n\n## The `x.py` part (two)\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#the-xpy-part-two) [ok](#local) [bad](c.md) [bad](b.md#nope)\n"
                    "`[not a link](nowhere.md)`\n```\n[not a link](nowhere.md)\n```\n## Local\n")
    broken = broken_links(page, root=tmp_path)
    assert [b.split(": ")[1].split(" ")[0] for b in broken] == ["c.md", "b.md#nope"]


def test_the_template_keys_are_the_engine_config_fields():
    keys = template_keys()
    assert len(keys) == len(set(keys)) and set(keys) == {f.name for f in dataclasses.fields(EngineConfig)}


def test_every_config_key_is_documented_once_in_configuration_md():
    text = CONFIGURATION.read_text(encoding="utf-8")
    lines = [line for _, line in prose_lines(text)]
    problems = []
    for key in template_keys():
        entry = re.compile(rf"^(\|\s*|#{{1,6}}\s+)`{key}`(\s*\||\s*$|\s)")
        found = [line for line in lines if entry.match(line)]
        if len(found) != 1:
            problems.append(f"{key}: {len(found)} entries in docs/configuration.md (a table row or heading "
                            f"starting with `{key}`), not 1")
    assert not problems, "\n".join(problems)


def test_no_second_config_table_elsewhere():
    """A config key is described in docs/configuration.md's table only: no other page has a table row
    for it in a table of parameters (first column `parameter` or `key`) or giving its default."""
    defaults = dict(re.findall(r'^parameters \{ key: "(\w+)" value: \{ string_value: "([^"]*)" \} \}',
                               TEMPLATE.read_text(encoding="utf-8"), re.M))
    keys = set(defaults)
    assert keys == set(template_keys())
    found = []
    for path in markdown_files():
        if path == CONFIGURATION:
            continue
        for n, header, cells in table_rows(path.read_text(encoding="utf-8")):
            named = keys_of_cell(cells[0], keys) if cells else set()
            if not named:
                continue
            lowered = [h.lower() for h in header]
            is_param_table = lowered[0] in ("parameter", "parameters", "key", "config key", "setting")
            gives_default = any("default" in h and i < len(cells)
                                and cells[i].strip("`") in {defaults[k] or '""' for k in named}
                                for i, h in enumerate(lowered))
            if is_param_table or gives_default:
                found.append(f"{path.relative_to(ROOT)}:{n}: {', '.join(sorted(named))}")
    assert not found, "config keys described in a second table (keep them in docs/configuration.md):\n" + \
        "\n".join(found)


def test_readme_is_short_and_links_every_docs_page():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, \
        f"README.md has {len(text.splitlines())} lines; keep it under {README_MAX_LINES}, the reference in docs/"
    linked = {(README.parent / target.partition("#")[0]).resolve()
              for _, target in links(README) if not SCHEME.match(target) and target.partition("#")[0]}
    pages = sorted(DOCS.glob("*.md"))
    assert pages
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert not missing, f"README.md links no docs page named {missing}"
