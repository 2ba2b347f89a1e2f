"""The documentation stays true: README.md and docs/*.md.

- every relative link resolves: the file or directory exists in the repository, and a ``#anchor``
  into a markdown file names one of its headings (GitHub's slugs: lowercase, punctuation other
  than hyphens and underscores dropped, spaces -> hyphens, repeats numbered -1, -2, ...);
- every repository path written in backticks (or as an argument in a ``bash`` block) exists, and
  every module file named alone in backticks (``attn_fwd.py``) exists somewhere in the repository;
- every docs page opens with a code block before its first section;
- every code block fenced as ``python cpu`` runs, each in a fresh process on CPU: no CUDA device
  visible, ``TRITON_INTERPRET`` and ``COREATTN_BACKEND`` unset, so the default CPU backend (torch)
  runs it. Blocks fenced as plain ``python`` (GPU, process groups, downloads) are not run.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = ("python", "cpu")  # the info string of a block the test runs
TIMEOUT_S = 300  # per block; each takes a few seconds of CPU (importing torch is most of it)
UNSET = ("TRITON_INTERPRET", "COREATTN_BACKEND", "COREATTN_TRITON_TARGET", "COREATTN_VALIDATE")
EXTERNAL = {"compile_proxy.py"}  # the project's shared tool, kept outside this repository
OPTIONAL = ("transformers", "megatron")  # test extras: a block importing one is skipped without it

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*(.*)$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\]]|\][^(])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
REPO_PATH = re.compile(r"^(?:coreattn|tests|bench|docs|\.ci)/[\w./-]*$|^(?:README\.md|LICENSE|pyproject\.toml)$")


class Block(NamedTuple):
    page: Path
    line: int  # 1-based line of the opening fence
    info: tuple[str, ...]
    code: str


def split_page(path: Path) -> tuple[list[tuple[int, str]], list[Block]]:
    """The page's prose lines (outside fenced blocks, with line numbers) and its fenced blocks."""
    prose, blocks = [], []
    fence, info, start, body = None, (), 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = FENCE.match(line)
        if fence is None:
            if match:
                fence, info, start, body = match.group(1), tuple(match.group(2).split()), number, []
            else:
                prose.append((number, line))
        elif match and match.group(1).startswith(fence) and not match.group(2):
            blocks.append(Block(path, start, info, "\n".join(body) + "\n"))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{path.name}:{start}: unclosed code fence"
    return prose, blocks


def slug(heading: str) -> str:
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for _, line in split_page(path)[0]:
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def paragraphs(prose: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Consecutive prose lines joined (a code span may run over a line break, not over a blank line)."""
    found, first, lines = [], 0, []
    for number, line in prose + [(0, "")]:
        if line.strip() and (not lines or number == first + len(lines)):
            first = first if lines else number
            lines.append(line)
            continue
        if lines:
            found.append((first, "\n".join(lines)))
        first, lines = number, [line] if line.strip() else []
    return found


def _spans(path: Path) -> list[tuple[int, str, str]]:
    """(line, code span text, paragraph text with code spans blanked) for each prose paragraph."""
    found = []
    for first, text in paragraphs(split_page(path)[0]):
        blank = INLINE_CODE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        found.append((first, text, blank))
    return found


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for first, _, blank in _spans(path):
        found += [(first + blank[:m.start()].count("\n"), m.group(1)) for m in LINK.finditer(blank)]
    return found


def code_paths(path: Path) -> list[tuple[int, str]]:
    """Repository paths a page names: inline code spans, and arguments in bash blocks."""
    blocks = split_page(path)[1]
    found = [(first + text[:m.start()].count("\n"), " ".join(m.group(2).split()))
             for first, text, _ in _spans(path) for m in INLINE_CODE.finditer(text)]
    for block in blocks:
        if block.info[:1] == ("bash",):
            for offset, line in enumerate(block.code.splitlines(), 1):
                found += [(block.line + offset, word) for word in line.split("#")[0].split()]
    return [(number, p) for number, p in found if REPO_PATH.match(p)]


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page):
    broken = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if ROOT not in (dest, *dest.parents):
            broken.append(f"{page.name}:{number}: {target} leaves the repository")
        elif not dest.exists():
            broken.append(f"{page.name}:{number}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{page.name}:{number}: {target}: no heading with anchor #{anchor} in "
                          f"{page_id(dest)} ({sorted(anchors(dest))})")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_repository_paths_exist(page):
    missing = [f"{page.name}:{number}: {p}" for number, p in code_paths(page) if not (ROOT / p).exists()]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_modules_exist(page):
    """A bare ``name.py`` (as in docs/layout.md's lists) names a file somewhere in the repository."""
    names = {p.name for top in ("coreattn", "tests", "bench") for p in (ROOT / top).rglob("*.py")} | EXTERNAL
    spans = [(first + text[:m.start()].count("\n"), m.group(2)) for first, text, _ in _spans(page)
             for m in INLINE_CODE.finditer(text)]
    missing = [f"{page.name}:{number}: {name}" for number, name in spans
               if re.fullmatch(r"[\w-]+\.py", name) and name not in names]
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("page", [p for p in PAGES if p.parent == ROOT / "docs"], ids=page_id)
def test_docs_page_opens_with_a_snippet(page):
    prose, blocks = split_page(page)
    first_section = next((number for number, line in prose if re.match(r"^##\s", line)), None)
    assert blocks and (first_section is None or blocks[0].line < first_section), \
        f"{page_id(page)}: no code block before its first section"


def test_docs_have_runnable_blocks():
    runnable = [b for page in PAGES for b in split_page(page)[1] if b.info == RUNNABLE]
    assert {b.page.name for b in runnable} >= {"README.md", "usage.md", "features.md", "masks.md"}


def test_slug_follows_github():
    assert slug("Mask utilities (`coreattn.masks`)") == "mask-utilities-coreattnmasks"
    assert slug("Have a GPU? Run the self-check") == "have-a-gpu-run-the-self-check"
    assert slug("Dqk ≠ Dv, GQA") == "dqk--dv-gqa"
    assert slug("CI lanes") == "ci-lanes"
    assert slug("torch_backend and torch.compile") == "torch_backend-and-torchcompile"


RUNNABLE_BLOCKS = [b for page in PAGES for b in split_page(page)[1] if b.info == RUNNABLE]


def _imports(code: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("block", RUNNABLE_BLOCKS, ids=lambda b: f"{page_id(b.page)}:{b.line}")
def test_runnable_block_runs_on_cpu(block, tmp_path):
    missing = [m for m in OPTIONAL if m in _imports(block.code) and importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"needs {missing[0]} (the test extra)")
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env["CUDA_VISIBLE_DEVICES"] = ""  # CPU, the torch backend, wherever the suite runs
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", block.code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{page_id(block.page)}:{block.line} failed:\n{proc.stdout}\n{proc.stderr}"
