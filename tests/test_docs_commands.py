"""The commands of README.md and docs/*.md run as a reader pastes them, on a fresh copy of the
repository (the files git tracks) with the SmolLM2 file `make setup` downloads.

Every fenced block names its language. A `bash` or `python` block has a marker on the last
non-blank line before its fence:

    <!-- run -->                            run as written
    <!-- run: OLD => NEW; OLD2 => NEW2 -->  run with each OLD (which must occur) replaced by NEW,
                                            for shorter settings
    <!-- run slow: ... -->                  the same, only in the slow run (pytest -m slow)

A page other than the README runs all its blocks in the slow run (make test-all).
    <!-- not run: REASON -->                not run; REASON says why (a GPU, the network, minutes)

The blocks of one page run in order in one directory, so a block may use a file an earlier one
wrote. `python` in a command is the Python running the tests. In every shell block, run or not,
the flags given to a `python -m flexh2o.COMMAND` must be among those its --help names (those of
flexh2o.lm_eval are lm-eval's, checked where its blocks run), and a path into the repository's
code or configs must exist; every Python block must parse.
"""

import ast
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(REPO, "docs"))
                               if f.endswith(".md"))
SMOL_GGUF = os.path.join("models", "SmolLM2-135M-Instruct.Q4_1.gguf")
COMMAND_LANGUAGES = {"bash", "python"}
MARKER = re.compile(r"<!-- (run slow|run|not run)(?::(.*))? -->")
FENCE = re.compile(r"```(\S*)\s*$")
BLOCK_TIMEOUT_S = 600  # only a hang guard: a block that runs is never judged by its time


class Block:
    def __init__(self, page, line, language, text, marker):
        self.page, self.line, self.language, self.text = page, line, language, text
        self.kind, self.settings = marker if marker else (None, None)

    @property
    def where(self):
        return f"{self.page}:{self.line}"

    def substitutions(self) -> list[tuple[str, str]]:
        pairs = []
        for item in filter(None, (s.strip() for s in (self.settings or "").split(";"))):
            old, sep, new = item.partition("=>")
            assert sep and old.strip(), f"{self.where}: a setting is OLD => NEW, got {item!r}"
            pairs.append((old.strip(), new.strip()))
        return pairs

    def as_run(self) -> str:
        text = self.text
        for old, new in self.substitutions():
            assert old in text, f"{self.where}: the marker replaces {old!r}, which the block does not hold"
            text = text.replace(old, new)
        return text


def blocks_of(path: str, page: str) -> list[Block]:
    """The fenced blocks of the file at `path`, named `page` in messages."""
    lines = open(path, encoding="utf-8").read().splitlines()
    found, n = [], 0
    while n < len(lines):
        fence = FENCE.fullmatch(lines[n])
        if not fence:
            n += 1
            continue
        end = next((k for k in range(n + 1, len(lines)) if lines[k].strip() == "```"), None)
        assert end is not None, f"{page}:{n + 1}: a fence that never closes"
        before = next((lines[k].strip() for k in range(n - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.fullmatch(before)
        found.append(Block(page, n + 1, fence.group(1), "\n".join(lines[n + 1:end]) + "\n",
                           (marker.group(1), (marker.group(2) or "").strip()) if marker else None))
        n = end + 1
    return found


def page_blocks(page: str) -> list[Block]:
    return blocks_of(os.path.join(REPO, page), page)


ALL_BLOCKS = [b for page in PAGES for b in page_blocks(page)]


def marker_problems(blocks: list[Block]) -> list[str]:
    problems = []
    for b in blocks:
        if not b.language:
            problems.append(f"{b.where}: a fence without a language (```text for output, ```bash for commands)")
        elif b.language in COMMAND_LANGUAGES and not b.kind:
            problems.append(f"{b.where}: a {b.language} block needs <!-- run --> or <!-- not run: why --> before it")
        elif b.kind == "not run" and len(b.settings.split()) < 2:
            problems.append(f"{b.where}: <!-- not run: ... --> must say why")
        elif b.kind and b.language not in COMMAND_LANGUAGES:
            problems.append(f"{b.where}: a marker before a {b.language} block, which is never run")
    return problems


def test_every_block_names_its_language_and_every_command_block_its_marker():
    assert marker_problems(ALL_BLOCKS) == []


def shell_commands(text: str) -> list[list[str]]:
    """The block's commands as words, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


@functools.cache
def flags_of(module: str) -> frozenset:
    r = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", r.stdout))


def shell_problems(blocks: list[Block]) -> list[str]:
    """Flags a `python -m flexh2o.COMMAND` does not take, and paths into the code or configs that
    do not exist, in the shell blocks."""
    problems = []
    for b in (b for b in blocks if b.language == "bash"):
        for words in shell_commands(b.text):
            at = next((k + 1 for k, w in enumerate(words[:-1]) if w == "-m" and words[k + 1].startswith("flexh2o.")),
                      None)
            if at is not None and words[at] != "flexh2o.lm_eval":  # lm-eval's own flags pass through it
                known = flags_of(words[at])
                problems += [f"{b.where}: {words[at]} has no flag {w.split('=')[0]}" for w in words[at + 1:]
                             if w.startswith("--") and w.split("=")[0] not in known]
            problems += [f"{b.where}: {w} does not exist" for w in words
                         if w.split("/")[0] in ("flexh2o", "scripts", "configs", "tests") and "/" in w
                         and not os.path.exists(os.path.join(REPO, w))]
    return problems


def test_shell_blocks_name_real_flags_and_files():
    assert shell_problems(ALL_BLOCKS) == []


def test_python_blocks_parse():
    for b in (b for b in ALL_BLOCKS if b.language == "python"):
        try:
            ast.parse(b.text)
        except SyntaxError as e:
            pytest.fail(f"{b.where}: {e}")


def fresh_copy(dst: str) -> str:
    """dst: the repository's files as a clone has them, and the model `make setup` puts in models/."""
    r = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True)
    if r.returncode == 0:
        for name in filter(None, r.stdout.decode().split("\0")):
            if os.path.isfile(os.path.join(REPO, name)):  # a file deleted in the work tree is not copied
                os.makedirs(os.path.join(dst, os.path.dirname(name)), exist_ok=True)
                shutil.copy2(os.path.join(REPO, name), os.path.join(dst, name))
    else:  # no git: the tree, less what git ignores here
        shutil.copytree(REPO, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
            ".git", ".venv", "models", "__pycache__", "*.egg-info", ".pytest_cache", "serve-state", "wheels"))
    os.makedirs(os.path.join(dst, "models"), exist_ok=True)
    if os.path.isfile(os.path.join(REPO, SMOL_GGUF)):
        os.symlink(os.path.join(REPO, SMOL_GGUF), os.path.join(dst, SMOL_GGUF))
    return dst


def run_block(block: Block, cwd: str, bin_dir: str, pythonpath: str) -> subprocess.CompletedProcess:
    """Runs the block as its marker says, in cwd, with `python` the tests' Python (a script in bin_dir)."""
    python = os.path.join(bin_dir, "python")
    if not os.path.exists(python):
        with open(python, "w") as f:
            f.write(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        os.chmod(python, 0o755)
    env = dict(os.environ, PYTHONPATH=pythonpath,
               PATH=os.pathsep.join([bin_dir, os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    code = block.as_run()
    argv = ["bash", "-e", "-o", "pipefail", "-c", code] if block.language == "bash" else [sys.executable, "-c", code]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)


# make test runs the README's commands, what a new user pastes first; the other pages' commands
# (their flags and paths still checked above) run in make test-all, which keeps make test in its
# 10 minutes: each block starts Python and torch again.
DEFAULT_PAGES = ("README.md",)


def page_cases():
    for page in PAGES:
        runnable = [b for b in page_blocks(page) if b.kind in ("run", "run slow")]
        if page not in DEFAULT_PAGES:
            if runnable:
                yield pytest.param(page, True, id=page, marks=pytest.mark.slow)
            continue
        if any(b.kind == "run" for b in runnable):
            yield pytest.param(page, False, id=page)
        if any(b.kind == "run slow" for b in runnable):
            yield pytest.param(page, True, id=page + "-slow", marks=pytest.mark.slow)


@pytest.mark.timeout(3 * BLOCK_TIMEOUT_S)  # over pyproject's 300 s: a page of several runs on a busy machine
@pytest.mark.parametrize("page,slow", list(page_cases()))
def test_the_pages_commands_run(page, slow, tmp_path):
    blocks = [b for b in page_blocks(page) if b.kind == "run" or (slow and b.kind == "run slow")]
    if any(SMOL_GGUF in b.text for b in blocks) and not os.path.isfile(os.path.join(REPO, SMOL_GGUF)):
        pytest.skip(f"{SMOL_GGUF} is missing (make setup downloads it)")
    work = fresh_copy(str(tmp_path / "clone"))
    (tmp_path / "bin").mkdir()
    for b in blocks:
        r = run_block(b, work, str(tmp_path / "bin"), work)
        assert r.returncode == 0, (f"{b.where} failed (exit {r.returncode}):\n{b.as_run()}\n"
                                   f"--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}")


def test_the_checks_catch_a_stale_block(tmp_path):
    """A block without a marker, a flag that no longer exists, a file nothing made, a marker that
    replaces what the block does not hold: each fails."""
    page = tmp_path / "page.md"
    page.write_text("```bash\npython -m flexh2o.run\n```\n\n"
                    "<!-- not run: -->\n```bash\nmake gpu-check\n```\n\n"
                    "<!-- run -->\n```bash\npython -m flexh2o.run --no-such-flag\n```\n\n"
                    "<!-- run: a.txt => b.txt -->\n```bash\ncat a.txt\n```\n\n"
                    "<!-- run: --gen-len 4 => --gen-len 2 -->\n```bash\npython -m flexh2o.run --gen-len 8\n```\n")
    blocks = blocks_of(str(page), "page.md")
    assert len(marker_problems(blocks)) == 2
    assert shell_problems(blocks) == ["page.md:11: flexh2o.run has no flag --no-such-flag"]
    (tmp_path / "bin").mkdir()
    for b in blocks[2:4]:
        assert run_block(b, str(tmp_path), str(tmp_path / "bin"), REPO).returncode != 0
    with pytest.raises(AssertionError, match="does not hold"):
        blocks[4].as_run()
