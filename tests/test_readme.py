"""The docs agree with the program: every `p2p-diloco` command that README.md and bootstrap/README.md show
parses with the CLI as it is (flags, choices, files they name), every `python benchmarks/...` command
that a doc shows names a script that has its flags, every exit status the program uses is in the README's
table, and every link between the docs lands on a file and a heading that exist."""

from __future__ import annotations

import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from p2p_diloco import exit_codes
from p2p_diloco.manifest import find_manifest
from tests.cli_parse import subcommand_context

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
COMMAND_DOCS = [README, REPO / "bootstrap" / "README.md"]
ALL_DOCS = sorted([README, *REPO.glob("bootstrap/*.md"), *REPO.glob("docs/*.md"), *REPO.glob("docker/*.md"),
                   *REPO.glob("benchmarks/*.md")])
REPO_DIRS = ("peers/", "bootstrap/", "docs/", "docker/", "benchmarks/")


@dataclass(frozen=True)
class Shown:
    """One command line shown in a doc's code block."""

    where: str  # file:line
    words: tuple[str, ...]  # as the shell splits it, from the program on


def code_lines(doc: Path):
    """(line number, text) of each logical line inside the doc's fenced code blocks: `\\` continuations joined,
    a shell prompt (`$ `) dropped."""
    inside, pending, start = False, "", 0
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        text = line.strip().removeprefix("$ ")
        if not pending:
            start = number
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        yield start, pending + text
        pending = ""


def shown_commands(docs: list[Path], program: str) -> list[Shown]:
    """The command lines of `program` the docs show, one per `&&`-separated command: `<your public IP>`
    placeholders become one word, `...` (an elided part) is left out, `$(which p2p-diloco)` counts."""
    found = []
    for doc in docs:
        for number, line in code_lines(doc):
            line = re.sub(r"<[^<>]+>", "PLACEHOLDER", line.replace("$(which p2p-diloco)", "p2p-diloco"))
            for command in line.split("&&"):
                try:
                    words = shlex.split(command, comments=True)
                except ValueError:  # not a shell line (an output shown in a code block)
                    continue
                if program in words:
                    words = [word for word in words[words.index(program):] if word != "..."]
                    found.append(Shown(f"{doc.relative_to(REPO)}:{number}", tuple(words)))
    return found


CLI_COMMANDS = shown_commands(COMMAND_DOCS, "p2p-diloco")
BENCHMARK_COMMANDS = [shown for shown in shown_commands(ALL_DOCS, "python")
                      if len(shown.words) > 1 and shown.words[1].startswith("benchmarks/")]


def test_the_docs_show_commands():
    """The extraction finds what the docs show, so that the tests below cannot pass on nothing."""
    subcommands = {shown.words[1] for shown in CLI_COMMANDS if len(shown.words) > 1}
    assert {"demo", "bootstrap", "join", "status", "export", "peer"} <= subcommands
    assert len(BENCHMARK_COMMANDS) >= 10


@pytest.fixture
def a_users_directory(tmp_path, monkeypatch):
    """Where a user runs the README's commands: `my-run.toml` is their copy of the template, as the README
    says to make it."""
    shutil.copy(REPO / "peers" / "llama-150m-c4.toml", tmp_path / "my-run.toml")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("shown", [shown for shown in CLI_COMMANDS if len(shown.words) > 1],
                         ids=lambda shown: shown.where)
def test_a_shown_command_parses_and_names_files_that_exist(shown, a_users_directory):
    ctx = subcommand_context(list(shown.words[1:]))
    manifest = ctx.params.get("manifest")
    if manifest is not None:
        assert find_manifest(manifest).is_file()
    for word in shown.words:
        if word.startswith(REPO_DIRS):
            assert (REPO / word).exists(), f"{shown.where}: {word} is not in the repository"


def with_shared_options(script: Path) -> str:
    """The script's source and that of the benchmarks it imports from (quality.py's shared run options)."""
    source = script.read_text()
    imported = re.findall(r"^from (\w+) import", source, flags=re.MULTILINE)
    return "\n".join([source] + [(script.parent / f"{name}.py").read_text() for name in imported
                                  if (script.parent / f"{name}.py").is_file()])


@pytest.mark.parametrize("shown", BENCHMARK_COMMANDS, ids=lambda shown: shown.where)
def test_a_shown_benchmark_exists_with_its_flags(shown):
    script = REPO / shown.words[1]
    assert script.is_file(), f"{shown.where}: no {shown.words[1]}"
    source = with_shared_options(script)
    for word in shown.words[2:]:
        flag = word.split("=")[0]
        if flag.startswith("--") and flag != "--help":
            assert f'"{flag}"' in source, f"{shown.where}: {shown.words[1]} has no {flag}"


def test_every_exit_status_is_in_the_readme():
    table = dict(re.findall(r"^\| `(\d+)` \| (.+) \|$", README.read_text(), flags=re.MULTILINE))
    statuses = {name: value for name, value in vars(exit_codes).items()
                if name.startswith("EXIT_") and isinstance(value, int)}
    assert statuses
    for name, value in statuses.items():
        assert str(value) in table, f"{name} = {value} is not in the README's table of exit statuses"
    assert "1" in table  # an unexpected error: not a constant, a traceback


def heading_anchors(doc: Path) -> set[str]:
    """The anchors GitHub gives the doc's headings: lower case, punctuation dropped, spaces to hyphens, and a
    repeated heading numbered (`-1`, `-2`)."""
    anchors, seen = set(), {}
    for _, line in outside_code(doc):
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower().replace("`", "")).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def outside_code(doc: Path):
    inside = False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            inside = not inside
        elif not inside:
            yield number, line


@pytest.mark.parametrize("doc", ALL_DOCS, ids=lambda doc: str(doc.relative_to(REPO)))
def test_links_land_on_files_and_headings_that_exist(doc):
    checked = 0
    for number, line in outside_code(doc):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            assert dest.exists(), f"{doc.name}:{number}: {target} points to no file"
            if anchor and dest.suffix == ".md":
                assert anchor in heading_anchors(dest), f"{doc.name}:{number}: {target} points to no heading"
            checked += 1
    if doc == README:
        assert checked >= 10
