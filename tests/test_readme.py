"""The README's code blocks and links: each bash command names a make target, a program or an
option that exists and parses as shell; the layout map names real paths; links to docs/ reach
a heading there. Its Python blocks run against a live server in
``tests/deployments/test_serve_cli.py``."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_README_LINES = 300


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced blocks of ``text`` in ``language`` ("" for a plain fence), in order."""
    blocks, current, block_language = [], None, ""
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                block_language, current = line[3:].strip(), []
            else:
                if block_language == language:
                    blocks.append("\n".join(current) + "\n")
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def readme_python_blocks() -> list[str]:
    """The README's Python examples, in order (they share one namespace when run)."""
    return code_blocks(README, "python")


def commands() -> list[str]:
    """Each command line of the README's bash blocks (a trailing comment dropped)."""
    lines = []
    for block in code_blocks(README, "bash"):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def make_targets() -> set[str]:
    return set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_opens_with_the_two_commands_and_stays_short():
    first_block = code_blocks(README, "bash")[0]
    assert README[: README.index(first_block)].count("\n") < 5
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "serve"], ["make", "test"]]
    assert len(README.splitlines()) <= MAX_README_LINES


def test_every_bash_command_parses_and_names_what_exists():
    from deployments.cli import parser

    for command in commands():
        check = subprocess.run(["bash", "-n", "-c", command], capture_output=True, text=True)
        assert check.returncode == 0, (command, check.stderr)
        for part in re.split(r"&&|\|", command):
            words = shlex.split(part)
            if words[0] == "make":
                assert words[1] in make_targets(), command
            elif words[0].startswith(".venv/bin/"):
                program = words[0].removeprefix(".venv/bin/")
                if program == "nasd-serve":
                    parser().parse_args(words[1:] if "--help" not in words else [])
                elif program == "python":
                    assert (
                        words[1] == "-m" and (ROOT / words[2].replace(".", "/")).with_suffix(".py").exists()
                    )


def test_the_benchmark_check_the_readme_shows_passes():
    (command,) = [line for line in commands() if "benchmarks.report --check" in line]
    result = subprocess.run(shlex.split(command), cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_layout_map_names_real_paths():
    (tree,) = [block for block in code_blocks(README, "") if "nasd_core/" in block]
    parent = ROOT
    for line in tree.splitlines():
        names = re.split(r",\s*", re.split(r"\s{2,}", line.strip())[0])
        for name in names:
            path = (ROOT if not line.startswith(" ") else parent) / name.rstrip("/")
            assert path.exists(), line
        if not line.startswith(" "):
            parent = ROOT / names[0].rstrip("/")


@pytest.mark.parametrize("link", sorted(set(re.findall(r"\]\((docs/[^)]+)\)", README))))
def test_every_link_to_docs_reaches_a_file_and_heading(link):
    path, _, anchor = link.partition("#")
    document = (ROOT / path).read_text()
    if anchor:
        headings = [slug(line.lstrip("#")) for line in document.splitlines() if line.startswith("#")]
        assert anchor in headings, f"{link}: no such heading"


def test_the_readme_python_examples_compile():
    blocks = readme_python_blocks()
    assert len(blocks) >= 3
    for block in blocks:
        compile(block, "README.md", "exec")
