"""course/GLOSSARY.md stays true to the chapters: every term is used in some chapter, its "first
met" column names the chapter of its first use, the rows are in chapter order, and no entry is
empty.

A term is *used* where one of the spellings of its row's "written as" column appears in a chapter
notebook (`course/NN_*.ipynb`): in a markdown cell or in a `#` comment of a code cell (code itself
does not count: a name in code is not the place a reader is taught a term). Chapters are read in
number order. Matching is case-insensitive, on word boundaries (letters, digits and `_` are word
characters), markdown's `*` and backticks ignored, with `-`, `_` and a space interchangeable or left out ("all-reduce" finds
"all_reduce", "All-Reduce", "AllReduce", "all reduce"), and an English plural (-s, -es) allowed.
A spelling with two or more capitals is an abbreviation or a name and matches with its case
("ZeRO" is not "zeros", "MAD" not "mad", "DP" not `labkit.dp`). Other inflected forms and synonyms
count only when the row lists them ("sharded" for shard); a row may list only the forms of its own
sense ("pipeline stage", not "stage", which chapter 3 uses for ZeRO's stages).

The rows after the main table ("from the source notes, not used in the chapters") must be unused:
a chapter that starts using one moves it into the main table.
"""
import io
import json
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "course" / "GLOSSARY.md"
COLUMNS = ["term here", "written as", "Chinese in the source notes", "meaning in this course",
           "first met"]


def glossary_tables(text):
    """The file's tables, each a list of rows as dicts keyed by COLUMNS; raises if a header is
    not COLUMNS or a row has another number of cells."""
    tables, lines = [], text.splitlines() + [""]
    block = []
    for line in lines:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            tables.append(_table(block))
            block = []
    if not tables:
        raise ValueError(f"{GLOSSARY}: no table found")
    return tables


def _table(lines):
    header = [cell.strip() for cell in lines[0].strip().strip("|").split("|")]
    if header != COLUMNS:
        raise ValueError(f"{GLOSSARY}: header is {header}, expected {COLUMNS}")
    rows = []
    for number, line in enumerate(lines[2:], start=3):
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != len(COLUMNS):
            raise ValueError(f"{GLOSSARY}, table line {number}: {len(cells)} cells, expected "
                             f"{len(COLUMNS)} (a '|' inside a cell?): {line}")
        rows.append(dict(zip(COLUMNS, cells)))
    return rows


def glossary_rows(text):
    """The main table's rows (the first table)."""
    return glossary_tables(text)[0]


def spellings(row):
    """The row's spellings: its "written as" cell split on commas, backticks dropped."""
    return [s.strip().strip("`").strip() for s in row["written as"].split(",") if s.strip()]


def spelling_pattern(spelling):
    """A regex for one spelling under the module docstring's rule."""
    words = [re.escape(word) for word in re.split(r"[-_ ]+", spelling) if word]
    body = r"[-_ ]?".join(words)
    flags = 0 if sum(ch.isupper() for ch in spelling) >= 2 else re.IGNORECASE
    return re.compile(rf"(?<![A-Za-z0-9_]){body}(?:s|es)?(?![A-Za-z0-9_])", flags)


def code_comments(source):
    """The `#` comments of one code cell (lines of IPython magics or shell escapes left out)."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    try:
        return [token.string for token in
                tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline)
                if token.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return re.findall(r"#[^\n]*", "\n".join(lines))


def chapter_texts(root=ROOT):
    """{chapter number: the chapter's markdown and code comments, in cell order}."""
    texts = {}
    for path in sorted((root / "course").glob("[0-9][0-9]_*.ipynb")):
        parts = []
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "markdown":
                parts.append(source)
            elif cell["cell_type"] == "code":
                parts.extend(code_comments(source))
        # emphasis and code marks are not part of a word: "*dynamic* scale", "`send` and `recv`"
        texts[int(path.name[:2])] = re.sub(r"[*`]", "", "\n".join(parts))
    return texts


def first_use(row, texts):
    """(chapter, spelling) of the row's first use, or (None, None) when no chapter uses it."""
    for chapter in sorted(texts):
        for spelling in spellings(row):
            if spelling_pattern(spelling).search(texts[chapter]):
                return chapter, spelling
    return None, None


def problems(rows, texts):
    """One line per wrong row: empty cells, a term no chapter uses, a wrong "first met", rows
    out of chapter order."""
    found = []
    previous = None
    for row in rows:
        term = row["term here"]
        empty = [column for column in COLUMNS if not row[column]]
        if empty:
            found.append(f"{term!r}: empty {', '.join(empty)}")
            continue
        chapter, spelling = first_use(row, texts)
        claimed = row["first met"]
        if chapter is None:
            found.append(f"{term!r}: no chapter uses any of {spellings(row)}; use it in a chapter "
                         f"or add the spelling the chapters use to its 'written as' cell")
        elif claimed != str(chapter):
            found.append(f"{term!r}: 'first met' says {claimed}, but chapter {chapter} uses it "
                         f"first (as {spelling!r})")
        if claimed.isdigit():
            if previous is not None and int(claimed) < previous:
                found.append(f"{term!r}: first met {claimed} comes after a row of chapter "
                             f"{previous}; keep the rows in chapter order")
            previous = int(claimed)
        else:
            found.append(f"{term!r}: 'first met' is {claimed!r}, expected a chapter number")
    return found


def test_glossary_first_met_is_the_chapter_of_first_use():
    tables = glossary_tables(GLOSSARY.read_text(encoding="utf-8"))
    texts = chapter_texts()
    assert len(texts) >= 10 and len(tables[0]) >= 100, (sorted(texts), len(tables[0]))
    wrong = problems(tables[0], texts)
    assert not wrong, "course/GLOSSARY.md disagrees with the chapters:\n" + "\n".join(wrong)


def test_terms_of_the_source_notes_only_are_unused():
    """The second table: terms of the source notes that no chapter uses. Once one is used, its row
    belongs in the main table, with its chapter."""
    tables = glossary_tables(GLOSSARY.read_text(encoding="utf-8"))
    assert len(tables) == 2, f"expected the main table and the unused terms, found {len(tables)} tables"
    texts = chapter_texts()
    used = [f"{row['term here']!r}: chapter {first_use(row, texts)[0]} uses it (as "
            f"{first_use(row, texts)[1]!r}); move it into the main table"
            for row in tables[1] if first_use(row, texts)[0] is not None]
    assert not used, "\n".join(used)
    assert all(row["Chinese in the source notes"] and row["meaning in this course"]
               for row in tables[1]), tables[1]


def test_terms_are_unique():
    tables = glossary_tables(GLOSSARY.read_text(encoding="utf-8"))
    terms = [row["term here"].lower() for table in tables for row in table]
    assert len(terms) == len(set(terms)), sorted(t for t in terms if terms.count(t) > 1)


# The checker itself, on a small made-up course: each kind of wrong row is caught.
ROW = "| shard | shard, sharded | 分片 | the part one rank holds | {} |"
HEADER = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"


def _course(tmp_path, cells_by_chapter):
    (tmp_path / "course").mkdir()
    for chapter, cells in cells_by_chapter.items():
        notebook = {"cells": [{"cell_type": kind, "source": source} for kind, source in cells]}
        (tmp_path / "course" / f"{chapter:02d}_x.ipynb").write_text(json.dumps(notebook))
    return chapter_texts(tmp_path)


def test_the_checker_finds_each_kind_of_wrong_row(tmp_path):
    texts = _course(tmp_path, {
        0: [("markdown", "Ranks and worlds."), ("code", "shard = 1  # not yet the term\nx = 'shard'")],
        1: [("code", "%%ranks\ny = 2  # the Sharded  state")],
        2: [("markdown", "Each rank keeps its shards; an All-Reduce, then a flight recorder.")]})
    assert first_use(glossary_rows(HEADER + ROW.format(1))[0], texts) == (1, "sharded")
    assert not problems(glossary_rows(HEADER + ROW.format(1)), texts)
    assert "chapter 1 uses it first" in problems(glossary_rows(HEADER + ROW.format(2)), texts)[0]
    unused = HEADER + "| gradient | gradient | 梯度 | d loss / d w | 0 |"
    assert "no chapter uses" in problems(glossary_rows(unused), texts)[0]
    empty = HEADER + "| gradient | gradient | 梯度 |  | 0 |"
    assert "empty meaning" in problems(glossary_rows(empty), texts)[0]
    order = HEADER + ROW.format(1) + "\n| all_reduce | all_reduce | All-Reduce | sum | 2 |\n" \
        + "| recorder | flight recorder | | ring buffer | 2 |\n" + ROW.format(1).replace("shard |", "x |", 1)
    found = problems(glossary_rows(order), texts)
    assert any("empty Chinese" in line for line in found), found
    assert any("keep the rows in chapter order" in line for line in found), found
    with pytest.raises(ValueError, match="header"):
        glossary_rows("| term | first met |\n|---|---|\n| a | 0 |")
