#!/usr/bin/env python
"""Docstring lines per code line in ``normexp/`` (the prose budget: <= 0.15; timm's is about 0.10), and the
median sentence length of the docs (README.md and docs/*.md: <= 22 words).

Docstring lines are the lines spanned by module, class and function docstrings; code lines are the other
non-blank lines that are not comments only. A docs sentence is prose outside code blocks, tables and
headings, ended by '.', '?' or '!' before a space or the paragraph's end. ``tests/test_prose.py`` checks
both budgets.

    python scripts/prose_metrics.py [--worst 15] [--frozen normexp/run.py ...]

``--frozen`` names files that cannot be edited now: the script also prints the ratio the tree would have
if each of them were at the budget.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import statistics
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET = 0.15
SENTENCE_BUDGET = 22  # median words per docs sentence


def counts(source: str) -> tuple[int, int]:
    """(docstring lines, code lines) of one Python source."""
    doc: set[int] = set()
    stack: list[ast.AST] = [ast.parse(source)]
    while stack:  # statements only: a docstring is the first statement of a module, class or function
        node = stack.pop()
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                doc.update(range(first.lineno, first.end_lineno + 1))
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                stack.extend(child for child in children if isinstance(child, ast.AST))
    code: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    for kind, _, (first, _), (last, _), _ in tokenize.generate_tokens(io.StringIO(source).readline):
        if kind not in skip:
            code.update(range(first, last + 1))
    return len(doc), len(code - doc)


def measure(root: Path = ROOT) -> dict[str, tuple[int, int]]:
    """Relative path -> (docstring lines, code lines), for every module of ``root/normexp``."""
    return {str(path.relative_to(root)): counts(path.read_text())
            for path in sorted((root / "normexp").rglob("*.py"))}


def ratio(table: dict[str, tuple[int, int]]) -> float:
    return sum(d for d, _ in table.values()) / max(1, sum(c for _, c in table.values()))


def docs_sentences(root: Path = ROOT) -> dict[str, list[int]]:
    """Relative path -> the word count of each prose sentence of README.md and docs/*.md."""
    found = {}
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
        paragraphs = re.split(r"\n\s*\n", text)
        prose = [" ".join(p.split()) for p in paragraphs
                 if p.strip() and not p.lstrip().startswith(("#", "|", "<!--"))]
        found[str(path.relative_to(root))] = [
            len(sentence.split()) for paragraph in prose
            for sentence in re.split(r"(?<=[.?!])\s+(?=[A-Z`(*\[])", paragraph) if sentence.split()]
    return found


def median_words(found: dict[str, list[int]]) -> float:
    return statistics.median(n for counts in found.values() for n in counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worst", type=int, default=15)
    parser.add_argument("--frozen", nargs="*", default=[])
    args = parser.parse_args()
    table = measure()
    doc, code = sum(d for d, _ in table.values()), sum(c for _, c in table.values())
    print(f"normexp/: {doc} docstring lines / {code} code lines = {ratio(table):.3f} (budget {BUDGET})")
    if args.frozen:
        capped = {name: (min(d, int(BUDGET * c)), c) if name in args.frozen else (d, c)
                  for name, (d, c) in table.items()}
        print(f"with the frozen files at most at the budget: {ratio(capped):.3f}")
    found = docs_sentences()
    every = [n for counts in found.values() for n in counts]
    print(f"docs: {len(every)} sentences, median {median_words(found):g} words (budget "
          f"{SENTENCE_BUDGET}), {sum(n > 40 for n in every) / len(every):.0%} over 40")
    print(f"\n{'ratio':>6} {'doc':>5} {'code':>5}  file")
    worst = sorted(table.items(), key=lambda item: -item[1][0] / max(1, item[1][1]))[: args.worst]
    for name, (d, c) in worst:
        print(f"{d / max(1, c):6.2f} {d:5d} {c:5d}  {name}")


if __name__ == "__main__":
    main()
