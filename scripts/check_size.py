#!/usr/bin/env python3
"""Size limits that keep the code readable (run by scripts/lint.sh).

Each is an error (exit 1), printed with where it is:
- no unit in csrc/ or pycomm/ over MAX_UNIT_LINES lines, a unit being a
  source together with its header (``foo.cc`` + ``foo.h``, ``foo.cpp`` +
  ``foo.h``: the same stem in the same folder; a file with no partner, and
  every Python module, is a unit alone);
- no function over MAX_FUNCTION_LINES lines of logic: blank lines, comments
  and (Python) docstrings do not count; nested functions and lambdas count
  towards the function that holds them.

Python functions are found with `ast`; C++/CUDA function bodies with a brace
scanner over the text with comments and literals removed (a `{` that follows
a parameter list, outside any other function body).

    python scripts/check_size.py [--max-unit N] [--max-function N] [ROOT ...]
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

MAX_UNIT_LINES = 700
MAX_FUNCTION_LINES = 60
ROOTS = ("csrc", "pycomm")
CPP_SUFFIXES = {".cc", ".cpp", ".h", ".cu", ".cuh"}
# Keywords whose `(...) {` opens a block inside a function, not a function.
NOT_FUNCTIONS = re.compile(r"^\s*(if|for|while|switch|catch|else|do|return|namespace|class|struct|"
                           r"enum|union|extern)\b")


def python_functions(path: Path, text: str) -> list[tuple[int, str, int]]:
    lines = text.splitlines()
    tree = ast.parse(text, filename=str(path))
    docstring_lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstring_lines.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        logic = sum(1 for n in range(start, (node.end_lineno or node.lineno) + 1)
                    if n not in docstring_lines and lines[n - 1].strip()
                    and not lines[n - 1].strip().startswith("#"))
        out.append((node.lineno, node.name, logic))
    return out


def strip_cpp(text: str) -> str:
    """`text` with comments, string and character literals blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("\n" * text.count("\n", i, j))
            i = j
        elif text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = text.find(")" + (m.group(1) if m else "") + '"', i)
            j = n if end < 0 else end + len(m.group(1) if m else "") + 2
            out.append('""' + "\n" * text.count("\n", i, j))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def cpp_functions(path: Path, text: str) -> list[tuple[int, str, int]]:
    """(first line, name, lines of logic) of every function body in ``text``."""
    code = strip_cpp(text)
    lines = code.splitlines()
    out: list[tuple[int, str, int]] = []
    # Each open brace: (is_function, line index, header text)
    stack: list[tuple[bool, int, str]] = []
    header_start = 0
    line = 0
    for i, c in enumerate(code):
        if c == "\n":
            line += 1
        elif c in ";":
            header_start = i + 1
        elif c == "{":
            header = code[header_start:i].strip()
            inside_fn = any(f for f, _, _ in stack)
            is_fn = (not inside_fn and header.rstrip().endswith((")", "const", "override", "noexcept",
                                                                 "final"))
                     and "(" in header and not NOT_FUNCTIONS.match(header.splitlines()[-1]
                                                                    if header else "")
                     and not header.lstrip().startswith(("if", "for", "while", "switch")))
            if not inside_fn and not is_fn and "(" in header and re.search(r"\)\s*(->\s*[\w:<>,\s*&]+)?$",
                                                                          header) \
                    and not NOT_FUNCTIONS.match(header):
                is_fn = True
            # Constructors with member initialiser lists: `X::X(...) : a_(b), c_(d) {`.
            if not inside_fn and not is_fn and re.search(r"\)\s*:\s*\w", header) \
                    and not NOT_FUNCTIONS.match(header):
                is_fn = True
            stack.append((is_fn, line, header))
            header_start = i + 1
        elif c == "}":
            if stack:
                is_fn, start, header = stack.pop()
                if is_fn:
                    body = lines[start:line + 1]
                    logic = sum(1 for s in body if s.strip() not in ("", "{", "}", "};"))
                    name = re.findall(r"([~\w:]+)\s*\(", header)
                    out.append((start + 1, name[0] if name else "?", logic))
            header_start = i + 1
    return out


def units(paths: list[Path]) -> dict[str, list[Path]]:
    """Files grouped into units: a C++/CUDA source with the header of the
    same stem in the same folder (``csrc/torch/comm.{cpp,h}``); any other
    file alone."""
    groups: dict[tuple[Path, str], list[Path]] = {}
    for path in paths:
        key = (path.parent, path.stem if path.suffix in CPP_SUFFIXES else path.name)
        groups.setdefault(key, []).append(path)
    out = {}
    for (parent, stem), members in groups.items():
        if len(members) == 1:
            out[str(members[0])] = members
        else:
            suffixes = ",".join(sorted(p.suffix[1:] for p in members))
            out[f"{parent / stem}.{{{suffixes}}}"] = members
    return out


def check(roots: list[str], args: argparse.Namespace) -> list[str]:
    """The violations of the limits in the source files under ``roots``."""
    problems: list[str] = []
    paths = [p for root in roots for p in sorted(Path(root).rglob("*"))
             if p.suffix in CPP_SUFFIXES | {".py"} and p.is_file()]
    lines: dict[Path, int] = {}
    for path in paths:
        text = path.read_text()
        lines[path] = text.count("\n")
        found = python_functions(path, text) if path.suffix == ".py" else cpp_functions(path, text)
        for line, name, logic in found:
            if logic > args.max_function:
                problems.append(f"{path}:{line}: function {name} has {logic} lines of logic "
                                f"(limit {args.max_function})")
    for unit, members in sorted(units(paths).items()):
        total = sum(lines[p] for p in members)
        if total > args.max_unit:
            header = " with its header" if len(members) > 1 else ""
            problems.append(f"{unit}: {total} lines{header} (limit {args.max_unit})")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-unit", type=int, default=MAX_UNIT_LINES,
                    help="a source and its header together, at most this many lines")
    ap.add_argument("--max-function", type=int, default=MAX_FUNCTION_LINES,
                    help="a function, at most this many lines of logic")
    ap.add_argument("roots", nargs="*", default=list(ROOTS))
    args = ap.parse_args()
    problems = check(args.roots, args)
    for p in problems:
        print(p)
    print(f"check_size: {len(problems)} problem(s) (limits: units <= {args.max_unit} lines, "
          f"functions <= {args.max_function} lines of logic)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
