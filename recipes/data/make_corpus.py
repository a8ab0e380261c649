"""Regenerate corpus.txt from Python standard library docstrings (PSF License).

Run once and commit the output; nothing reads this at training time:

    python -m recipes.data.make_corpus            # writes recipes/data/corpus.txt

The text is the docstrings of a fixed, sorted list of standard-library modules
and of the public classes, functions and methods they define, cleaned to ASCII.
The shipped corpus.txt was produced with CPython 3.11; other versions word
their docstrings differently, which is why the output is committed rather than
rebuilt at run time.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
from collections.abc import Iterator
from pathlib import Path

MODULES = sorted([
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "cmd", "codecs",
    "collections", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "dis", "email.message", "enum", "filecmp",
    "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "gzip", "heapq", "hmac", "html.parser", "http.client", "imaplib", "inspect",
    "ipaddress", "json", "logging", "mailbox", "mimetypes", "numbers",
    "operator", "optparse", "os", "pathlib", "pdb", "pickle", "pprint", "queue",
    "random", "re", "sched", "shlex", "shutil", "smtplib", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "traceback", "typing", "unittest.case",
    "urllib.parse", "uuid", "warnings", "zipfile",
])

MAX_BYTES = 600_000
OUTPUT = Path(__file__).with_name("corpus.txt")

# Typographic characters that occur in docstrings, mapped to ASCII so the
# byte-level model sees one byte per character.
_ASCII = str.maketrans({
    "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
    "\u2013": "-", "\u2014": "--", "\u2026": "...", "\u00a0": " ",
})


def _public_members(owner: object, module_name: str) -> Iterator[tuple[str, object]]:
    """Public names defined (not merely imported) in ``owner``, sorted."""
    for name, obj in sorted(vars(owner).items()):
        if name.startswith("_"):
            continue
        if getattr(obj, "__module__", None) != module_name:
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj):
            yield name, obj


def iter_docstrings(module_name: str) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) for a module and what it defines."""
    module = importlib.import_module(module_name)
    yield module_name, inspect.getdoc(module) or ""
    for name, obj in _public_members(module, module_name):
        yield f"{module_name}.{name}", inspect.getdoc(obj) or ""
        if inspect.isclass(obj):
            for attr, method in _public_members(obj, module_name):
                yield f"{module_name}.{name}.{attr}", inspect.getdoc(method) or ""


def clean(text: str) -> str:
    text = text.translate(_ASCII).encode("ascii", "ignore").decode("ascii")
    text = text.replace("\t", "    ")
    lines = [line.rstrip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def build_corpus(modules: list[str] = MODULES, max_bytes: int = MAX_BYTES) -> str:
    seen: set[str] = set()
    parts: list[str] = []
    size = 0
    for module_name in modules:
        for qualname, doc in iter_docstrings(module_name):
            doc = clean(doc)
            # Short docs are mostly boilerplate ("Return self==value."), and
            # inherited docs would repeat verbatim.
            if len(doc) < 40 or doc in seen:
                continue
            seen.add(doc)
            entry = f"{qualname}\n{doc}\n\n"
            if size + len(entry) > max_bytes:
                return "".join(parts)
            parts.append(entry)
            size += len(entry)
    return "".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    text = build_corpus()
    args.output.write_text(text, encoding="ascii", newline="\n")
    print(f"wrote {len(text):,} bytes to {args.output}")


if __name__ == "__main__":
    main()
