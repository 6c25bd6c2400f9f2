"""README.md and docs/*.md: every relative link resolves, every documented command parses.

The README is the front door and `docs/` the reference; a page moved or a heading
renamed breaks a link, and an option renamed in code breaks a documented command: both fail here.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from megatron_tuning import commands as cli

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", REPO / "configs" / "README.md", *DOCS]

_FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
_PYTHON = re.compile(r"^[ \t]*```python\n(.*?)^[ \t]*```", re.S | re.M)
_INLINE_CODE = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
# A command line: optional VAR=value prefixes, then the module's command.
_COMMAND = re.compile(r"^\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*python -m megatron_tuning\b")


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return _FENCE.sub("", text)


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown text (duplicates get -1, -2, ...)."""
    anchors: set[str] = set()
    for line in _prose(text).splitlines():
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))  # a link keeps its text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def broken_links(page: Path) -> list[str]:
    """One line per relative link of ``page`` whose file, or heading, does not exist."""
    prose = _INLINE_CODE.sub("", _prose(page.read_text(encoding="utf-8")))
    problems = []
    for target in _LINK.findall(prose):
        if _URL_SCHEME.match(target):
            continue  # https:, mailto: are not files of this repository
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.name}: link {target!r}: {dest} does not exist")
        elif (
            anchor
            and dest.suffix == ".md"
            and anchor not in heading_anchors(dest.read_text(encoding="utf-8"))
        ):
            problems.append(
                f"{page.name}: link {target!r}: no heading of {dest.name} has the anchor #{anchor}"
            )
    return problems


def _command_words(line: str) -> list[list[str]]:
    """The argv lists one documented command line stands for.

    ``[--opt value]`` is an optional part: it is kept, so it is checked too. A bracket that holds no
    option (``[policy options]``) is a placeholder and is dropped. ``a / b`` lists alternatives.
    """
    line = re.sub(r"\[([^\]]*)\]", lambda m: m.group(1) if m.group(1).lstrip().startswith("-") else "", line)
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words.pop(0)
    assert words[:3] == ["python", "-m", "megatron_tuning"], line
    alternatives: list[list[str]] = [[]]
    for word in words[3:]:
        if word == "/":
            alternatives.append([])
        else:
            alternatives[-1].append(word)
    return alternatives


def documented_commands(text: str) -> list[list[str]]:
    """Every ``python -m megatron_tuning ...`` of a markdown text, in code blocks and inline code."""
    lines = []
    for block in _FENCE.findall(text):
        lines += [line for line in block.replace("\\\n", " ").splitlines() if _COMMAND.match(line)]
    for span in _INLINE_CODE.findall(_prose(text)):
        span = " ".join(span.split())  # an inline span may wrap onto the next line
        if _COMMAND.match(span):
            lines.append(span)
    return [words for line in lines for words in _command_words(line)]


def _is_command(name: str) -> bool:
    """``python -m megatron_tuning NAME --help`` exits 0: NAME is a command."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), pytest.raises(SystemExit) as exc:
        cli.build_parser([name]).parse_args([name, "--help"])
    return exc.value.code == 0


# A sentence that has the auto cache written at close(): docs/cache.md is the reference (issue 33).
_AT_CLOSE = re.compile(r"(?:merged|written|persist\w*)[^.]*?\bat\s+`(?:handle\.)?close\(\)`")


def cache_written_only_at_close(text: str) -> list[str]:
    """Paragraphs and table rows that have the ``auto`` cache written at ``close()`` without saying
    that a key this rank measured is written at once (kill-safe, DESIGN decision 16)."""
    parts = re.split(r"\n\s*\n|\n(?=\|)", _prose(text))
    return [part for part in parts if "cache" in part and _AT_CLOSE.search(part) and "at once" not in part]


# -- the checks themselves: they fire, and stay quiet --------------------------------------------


def test_a_broken_link_or_anchor_is_named(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Keys and identity\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md) [ok](other.md#keys-and-identity) [ok](#page) [web](https://x.org/a)\n"
        "[gone](missing.md) [bad heading](other.md#keys) `[in code](nowhere.md)`\n"
        "```\n[in a block](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(page)
    assert len(problems) == 2, problems
    assert "link 'missing.md'" in problems[0] and "does not exist" in problems[0]
    assert (
        "link 'other.md#keys'" in problems[1] and "no heading of other.md has the anchor #keys" in problems[1]
    )


def test_a_page_that_has_the_cache_written_only_at_close_is_named():
    only_at_close = "| `cache` | the cache: what it tuned is merged in at `close()` and at exit |\n"
    assert cache_written_only_at_close(only_at_close) == [only_at_close]
    apart = "The cache is merged into at `handle.close()`.\n\nA tuned key is written at once.\n"
    assert len(cache_written_only_at_close(apart)) == 1  # said in another paragraph: not next to it
    both = "The cache: a key this rank measured is written at once; adopted keys at `close()`.\n"
    assert cache_written_only_at_close(both) == []
    assert cache_written_only_at_close("A table is written at `close()`.\n") == []  # not the cache


def test_heading_anchors_follow_github():
    text = "# A `b.c` (d, e)\n## Record → merge → pin\n## Same\n## Same\n```\n# not a heading\n```\n"
    assert heading_anchors(text) == {"a-bc-d-e", "record--merge--pin", "same", "same-1"}


def test_commands_are_found_in_blocks_and_inline_code():
    text = (
        "Run `python -m megatron_tuning show t.msgpack`, or `python -m megatron_tuning\nexport t.msgpack`.\n"
        "```bash\n"
        "MT_X=1 python -m megatron_tuning run [--mode auto] [policy options] -- x.py # c\n"
        "python -m megatron_tuning enable / disable\n"
        "python -m megatron_tuning validate a.msgpack \\\n    --arch sm90\n"
        "torchrun train.py\n"
        "```\n"
    )
    assert documented_commands(text) == [
        ["run", "--mode", "auto", "--", "x.py"],
        ["enable"],
        ["disable"],
        ["validate", "a.msgpack", "--arch", "sm90"],
        ["show", "t.msgpack"],
        ["export", "t.msgpack"],
    ]


def test_a_renamed_option_or_command_would_fail():
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
        cli.build_parser(["show"]).parse_args(["show", "t.msgpack", "--no-such-option"])
    assert _is_command("export") and not _is_command("exports")


# -- the real pages ----------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


def test_no_page_has_the_auto_cache_written_only_at_close() -> None:
    pages = {str(page.relative_to(REPO)): page.read_text(encoding="utf-8") for page in PAGES}
    assert {name: found for name, text in pages.items() if (found := cache_written_only_at_close(text))} == {}


def test_the_readme_links_every_docs_page() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    linked = {(REPO / target.partition("#")[0]).resolve() for target in _LINK.findall(_prose(readme))}
    assert [p.name for p in DOCS if p.resolve() not in linked] == []
    assert len(DOCS) >= 10


def _all_commands() -> list[tuple[str, list[str]]]:
    return [
        (str(page.relative_to(REPO)), words)
        for page in PAGES
        for words in documented_commands(page.read_text(encoding="utf-8"))
    ]


def test_the_pages_show_commands() -> None:
    commands = _all_commands()
    assert len(commands) >= 40
    assert {words[0] for _, words in commands} >= {
        "show", "export", "import", "diff", "merge", "validate", "coverage", "selftest", "cache",
        "run", "enable", "disable", "tune",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("page", "argv"), _all_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v)
)
def test_every_documented_command_parses(page: str, argv: list[str]) -> None:
    if len(argv) == 1:  # a bare name: prose may name a command and leave its arguments out
        assert _is_command(argv[0]), f"{page}: {argv[0]!r} is not a command"
        return
    args = cli.build_parser(argv).parse_args(argv)
    assert args.command == argv[0] and args.handler is not None, f"{page}: {argv}"


def test_the_design_page_names_each_concept_with_a_module_that_exists() -> None:
    """docs/design.md: at most 25 concepts (issue 35) and the scoring kit's 3 (issue 34), each owned by
    one module of the package, and the list complete: the concepts a maintainer was found to need
    beyond the table are named in it."""
    text = (REPO / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| ([^|]+?) \| ([^|]+) \| `([^`]+)` \|$", text, re.M)
    concepts = [(name, owner) for name, _, owner in rows if name != "concept"]
    scoring = [name for name, owner in concepts if owner.startswith("score/")]
    assert len(concepts) - len(scoring) <= 25 and len(scoring) <= 3
    assert [owner for _, owner in concepts if not (REPO / "megatron_tuning" / owner).is_file()] == []
    assert len({owner for _, owner in concepts}) == len(concepts)  # one module per concept
    held = " ".join(f"{name} {what}" for name, what, _ in rows).lower()
    for needed in ("fast path", "late attach", "bootstrap", "by content", "key", "session number", "exit"):
        assert needed in held, needed


def python_commands(tree: ast.AST) -> list[list[str]]:
    """The argv of each ``[..., "-m", "megatron_tuning", COMMAND, ...]`` list of a Python example
    (its string constants after the module's name)."""
    commands = []
    for node in ast.walk(tree):
        if isinstance(node, ast.List):
            words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if "megatron_tuning" in words and words[words.index("megatron_tuning") - 1] == "-m":
                commands.append(words[words.index("megatron_tuning") + 1 :])
    return commands


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_python_example_compiles_and_its_commands_parse(page: Path) -> None:
    for block in _PYTHON.findall(page.read_text(encoding="utf-8")):
        for argv in python_commands(ast.parse(block)):
            args = cli.build_parser(argv).parse_args(argv)
            assert args.command == argv[0] and args.handler is not None, f"{page.name}: {argv}"


def test_the_launcher_page_shows_a_harness_that_kills_on_timeout() -> None:
    """An eval pipeline kills each candidate with subprocess.run(timeout=): the page shows that harness."""
    blocks = [ast.parse(b) for b in _PYTHON.findall((REPO / "docs" / "launcher.md").read_text())]
    harnesses = [
        tree
        for tree in blocks
        for call in ast.walk(tree)
        if isinstance(call, ast.Call)
        and ast.unparse(call.func) == "subprocess.run"
        and any(k.arg == "timeout" for k in call.keywords)
    ]
    assert len(harnesses) == 1 and [argv[0] for argv in python_commands(harnesses[0])] == ["run"]


def test_the_readme_says_what_each_of_the_two_commands_does_and_leaves_internals_to_development() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    assert "scripts/demo.sh" in section and "scripts/test.sh" in section and "min" in section
    assert "docs/development.md" in section and len(section.strip().splitlines()) <= 25
    internals = ("MT_TRITON_VERSIONS", "MT_TEST_WORKERS", "MT_FULL_MATRIX", "xdist", "lint-imports")
    development = (REPO / "docs" / "development.md").read_text(encoding="utf-8")
    assert [word for word in internals if word in section or word not in development] == []


def test_the_compile_page_says_first_that_torch_compile_needs_a_gpu() -> None:
    """On CPU Dynamo fails on Triton's interpreter, with the library or without: say so up front."""
    opening = (REPO / "docs" / "compile.md").read_text(encoding="utf-8").split("\n\n")[1]
    assert "needs a GPU" in opening and "TRITON_INTERPRET=1" in opening


def test_every_variable_a_page_names_is_a_knob() -> None:
    """docs/policy.md lists exactly the knobs (tests/core/test_policy.py); no other page names a
    variable that does not exist, or the launchers' plumbing, which is no knob."""
    from megatron_tuning.core.policy import KNOBS

    variable = re.compile(r"(?<![\w])MEGATRON_TUNING_[A-Z0-9_]*[A-Z0-9]")
    named = {name for page in PAGES for name in variable.findall(page.read_text(encoding="utf-8"))}
    assert named - set(KNOBS) == {"MEGATRON_TUNING_MOD"}  # launcher.md's example of a misspelt name
