"""The documentation agrees with the code: the pass table, the README's size, links and test command."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PASSES_DOC = ROOT / "docs" / "passes.md"
MAX_README_LINES = 200


def _table_rows(text: str, first_header: str) -> list[list[str]]:
    """The body rows of the markdown table whose first header cell is ``first_header``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        cells = _cells(line)
        if cells and cells[0].strip().lower() == first_header and i + 1 < len(lines) \
                and re.fullmatch(r"\|?(\s*:?-+:?\s*\|)+\s*:?-*:?\s*\|?", lines[i + 1].strip()):
            rows = []
            for body in lines[i + 2:]:
                if not body.strip().startswith("|"):
                    break
                rows.append(_cells(body))
            return rows
    raise AssertionError(f"no table with first column {first_header!r}")


def _cells(line: str) -> list[str]:
    line = line.strip()
    if not line.startswith("|"):
        return []
    # Split on pipes that are not inside backticks.
    cells, cell, in_code = [], "", False
    for ch in line.strip("|"):
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
    cells.append(cell.strip())
    return cells


def _builtin_passes() -> dict:
    import cann_passes
    # Tests register passes of their own (test_pass_manager); the table documents the built-in ones.
    return {name: info for name, info in cann_passes.registered_passes().items()
            if info.fn.__module__.startswith("cann_passes.")}


def _pass_table() -> list[list[str]]:
    return _table_rows(PASSES_DOC.read_text(), "pass")


def _name(cell: str) -> str:
    match = re.match(r"`([a-z][a-z0-9_]*)(\{[^`]*\})?`", cell)
    assert match, f"pass table: first cell {cell!r} is not a backticked pass name"
    return match.group(1)


def test_pass_table_lists_every_registered_pass_and_nothing_else():
    documented = [_name(row[0]) for row in _pass_table()]
    registered = set(_builtin_passes())
    assert len(documented) == len(set(documented)), f"pass table: rows repeated: {documented}"
    assert not registered - set(documented), f"registered but not in docs/passes.md: {sorted(registered - set(documented))}"
    assert not set(documented) - registered, f"in docs/passes.md but not registered: {sorted(set(documented) - registered)}"


def test_pass_table_files_and_options_exist():
    passes = _builtin_passes()
    for row in _pass_table():
        name = _name(row[0])
        files = re.findall(r"`([\w/.]+)`", row[1])
        assert files, f"pass table: {name} names no file"
        main = Path(files[0])
        # A pass module may be a file or a package of the same name.
        assert (ROOT / main).exists() or (ROOT / main.with_suffix("")).is_dir(), \
            f"pass table: {name}'s file {main} does not exist"
        module = passes[name].fn.__module__.replace(".", "/")
        assert str(main.with_suffix("")) in (module, module.removesuffix("/__init__")) \
            or module.startswith(str(main.with_suffix("")) + "/"), \
            f"pass table: {name} is defined in {module}, not {main}"
        documented = set(re.findall(r"`(\w+)`", row[2]))
        unknown = documented - set(passes[name].options)
        assert not unknown, f"pass table: {name} has no option(s) {sorted(unknown)}"


def test_readme_is_at_most_200_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"


def _relative_links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)   # code blocks hold no links
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


# The README and the pages it links to, but ARCHITECTURE.md.
DOC_PAGES = [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "ARCHITECTURE.md")]


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: p.name)
def test_relative_links_point_to_existing_files(page):
    links = _relative_links(page)
    if page == README:
        assert links, "README.md has no relative links"
    missing = [t for t in links if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.relative_to(ROOT)}: links to missing files: {missing}"


def _commands(path: Path) -> list[list[str]]:
    """The command lines of a shell script (comments, blanks and shell options left out)."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip() if not line.lstrip().startswith("#!") else ""
        if line and not line.startswith("set "):
            out.append(shlex.split(line))
    return out


def _readme_test_command() -> list[str]:
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", README.read_text(), flags=re.S)
    commands = [shlex.split(line) for block in blocks for line in block.splitlines()
                if "scripts/test" in line]
    assert len(commands) == 1, f"README.md: expected one test command, found {commands}"
    return commands[0]


def test_readme_test_command_is_what_ci_runs():
    command = _readme_test_command()
    assert command == ["./scripts/test.sh"]
    ci = _commands(ROOT / ".ci" / "run")
    # CI changes to the repository root, then runs exactly the README's command.
    assert ci[-1] == command, f".ci/run runs {ci[-1]}, the README says {command}"
    assert all(c[0] == "cd" for c in ci[:-1]), f".ci/run does more than the README's command: {ci}"
    script = _commands(ROOT / "scripts" / "test.sh")
    assert ["./scripts/setup.sh"] in script, "scripts/test.sh does not set up .venv"
    assert any(c[:4] == ["exec", ".venv/bin/python", "-m", "pytest"] or c[:3] == [".venv/bin/python", "-m", "pytest"]
               for c in script), "scripts/test.sh does not run pytest from .venv"


def test_readme_train_command_is_the_train_script():
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", README.read_text(), flags=re.S)
    assert any(line.strip() == "./scripts/train.sh" for block in blocks for line in block.splitlines())
    assert (ROOT / "scripts" / "train.sh").exists()


def test_readme_commands_use_the_venv():
    """Commands in the README run from a fresh clone once a script made .venv: no bare python."""
    text = README.read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    for line in [l for b in blocks for l in b.splitlines()] + spans:
        words = line.split()
        if len(words) > 1 and words[0] in ("python", "python3", "pip", "torchrun", "pytest"):
            pytest.fail(f"README.md: {line!r} runs a bare {words[0]}; use .venv/bin/{words[0]}")
