"""The README's examples against the API: its first two commands are ``make demo`` and ``make
test``; every ``checkpointer.NAME(...)`` in its Python blocks is exported and called with
arguments its signature takes; every ``checkpointer ...`` command line parses (usage checks
included); the targets it names are in the Makefile; its settings table names exactly the
``CHECKPOINTER_*`` environment variables the package's source mentions; its links resolve."""

from __future__ import annotations

import ast
import inspect
import re
import shlex
from pathlib import Path

import pytest

import checkpointer
from checkpointer.cli import _check_usage, build_parser

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
BLOCKS = re.findall(r"^```(\w*)\n(.*?)^```", README, re.MULTILINE | re.DOTALL)
# A setting's name as the source spells it, wherever it appears (os.environ.get("..."), a constant,
# a getter's table, a docstring): the scan does not depend on where the settings are read.
SETTING_NAME = re.compile(r"\bCHECKPOINTER_[A-Z0-9_]*[A-Z0-9]\b")


def python_calls() -> list[tuple[str, ast.Call]]:
    calls = []
    for lang, body in BLOCKS:
        if lang == "python":
            for node in ast.walk(ast.parse(body)):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "checkpointer"
                ):
                    calls.append((node.func.attr, node))
    return calls


def command_lines() -> list[list[str]]:
    lines = []
    for lang, body in BLOCKS:
        if lang == "bash":
            for line in body.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if "-m" in words and "checkpointer" in words:  # torchrun ... -m checkpointer ARGS
                    words = words[words.index("-m") + 1 :]
                if words and words[0] == "checkpointer":
                    lines.append(words[1:])
    lines += [shlex.split(cmd)[1:] for cmd in re.findall(r"\| `(checkpointer [^`|]+)` \|", README)]  # the table
    return lines


def test_the_first_commands_are_make_demo_and_make_test():
    lang, body = BLOCKS[0]
    commands = [line.split("#")[0].strip() for line in body.splitlines() if line.strip()]
    assert (lang, commands[:2]) == ("bash", ["make demo", "make test"])


def test_the_readme_has_what_users_look_for():
    assert "## Command line" in README
    for command in ("inspect", "verify", "unshard", "convert"):
        assert f"`{command} " in README, command
    assert "latest_checkpoint(run_dir)" in README
    assert "make fuzz" in README


def test_make_targets_named_exist():
    makefile = (REPO / "Makefile").read_text()
    for target in set(re.findall(r"`?make (\w+)`?", README)):
        assert re.search(rf"^{target}:", makefile, re.MULTILINE), target


@pytest.mark.parametrize("name, call", python_calls(), ids=lambda v: v if isinstance(v, str) else "")
def test_python_examples_match_the_signatures(name, call):
    assert name in checkpointer.__all__, f"README calls checkpointer.{name}, which is not exported"
    signature = inspect.signature(getattr(checkpointer, name))
    positional = [ast.Constant(None)] * len(call.args)
    keywords = {kw.arg: None for kw in call.keywords}
    signature.bind(*positional, **keywords)  # TypeError: the README calls it in a way it cannot be


def test_the_resume_example_checks_for_none():
    resume = next(body for lang, body in BLOCKS if lang == "python" and "latest_checkpoint" in body)
    assert "is not None" in resume


@pytest.mark.parametrize("argv", command_lines(), ids=" ".join)
def test_command_line_examples_parse(argv):
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_usage(parser, args)


def test_there_are_examples_of_every_command():
    assert {argv[0] for argv in command_lines()} == {"inspect", "verify", "unshard", "convert", "prune"}


def settings_the_package_reads() -> dict[str, list[str]]:
    """Every ``CHECKPOINTER_*`` name in ``checkpointer/**/*.py`` -> the files that mention it."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "checkpointer").rglob("*.py")):
        for name in set(SETTING_NAME.findall(path.read_text(encoding="utf-8"))):
            found.setdefault(name, []).append(str(path.relative_to(REPO)))
    return found


def settings_table() -> list[list[str]]:
    """The rows of the table under ``## Settings``: [name, default, meaning]."""
    section = README.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| `")]
    return [[row[0].strip("`"), *row[1:]] for row in rows]


def test_the_settings_table_names_every_setting_the_package_reads():
    read = settings_the_package_reads()
    assert len(read) >= 8, sorted(read)  # the scan still finds them
    listed = [row[0] for row in settings_table()]
    assert len(listed) == len(set(listed)), f"listed twice: {sorted(n for n in listed if listed.count(n) > 1)}"
    missing = {name: read[name] for name in sorted(set(read) - set(listed))}
    unread = sorted(set(listed) - set(read))
    assert not missing, f"the README's settings table lacks {missing} (name: the files that read it)"
    assert not unread, f"the README's settings table lists {unread}, which nothing in checkpointer/ reads"


def test_every_setting_has_a_default_and_a_meaning():
    for name, default, meaning in settings_table():
        assert default and len(meaning) > 10, name


def test_the_readme_links_resolve():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith(("http://", "https://")):
            assert (REPO / target).exists(), f"README links to {target}, which does not exist"


def test_the_readme_is_read_in_five_minutes():
    """At most 150 lines: what it is, install, use, resume, CLI, remote, settings, on disk,
    performance, links. Journals and design notes live in docs/ and benchmarks/."""
    lines = README.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines"
