"""docs/security.md keeps a test for every claim: each test it names exists, each claim names one, and no page or
message tells the user to open up (or `chmod`) /tmp or /dev/shm (issue 23).

The page is parsed, the test files too (``ast``: nothing is imported). A reference is a code span
`path/test_file.py::test_name` (a parametrised case: `...::test_name[its-id]`); `::test_name`
names a test of the file named just before it; a file named without a folder is in `tests/loader/`.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "security.md"
BARE_FOLDER = Path("tests/loader")  # where the page's intro says a file named without a folder is

_SPAN = re.compile(r"`([^`\n]+)`")
_REFERENCE = re.compile(r"(?P<file>(?:[\w.-]+/)*test_\w+\.py)?(?:::(?P<name>test_\w+)(?:\[(?P<id>[^\]]+)\])?)?")


@dataclass(frozen=True)
class Reference:
    line: int
    text: str
    file: Path  # relative to the repository
    name: str | None  # None: the file only
    case: str | None  # a parametrised case's id


def references(text: str) -> list[Reference]:
    """Every test reference of ``text`` in order, with `::name` resolved to the file named before it."""
    found, previous = [], None
    for span in _SPAN.finditer(text):
        match = _REFERENCE.fullmatch(span.group(1))
        if match is None or not (match["file"] or match["name"]):
            continue
        line = text.count("\n", 0, span.start()) + 1
        if match["file"]:
            previous = Path(match["file"]) if "/" in match["file"] else BARE_FOLDER / match["file"]
        assert previous is not None, f"docs/security.md:{line}: `{span.group(1)}` follows no file"
        found.append(Reference(line, span.group(1), previous, match["name"], match["id"]))
    return found


@cache
def _module(path: Path) -> ast.Module:
    return ast.parse((ROOT / path).read_text(encoding="utf-8"), filename=str(path))


def _test_function(path: Path, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The module-level function ``name``, or one of a test class in it."""
    for node in _module(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for child in node.body:
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == name:
                    return child
    return None


def _has_case(path: Path, function: ast.FunctionDef | ast.AsyncFunctionDef, case: str) -> bool:
    """Whether ``function`` is parametrised and ``case`` is an id its file spells out (``ids=``/``pytest.param``
    strings, or the values of simple parameters joined by '-', as pytest makes them)."""
    parametrised = any("parametrize" in ast.unparse(d) for d in function.decorator_list)
    spelled = {str(node.value) for node in ast.walk(_module(path)) if isinstance(node, ast.Constant)}
    return parametrised and (case in spelled or all(part in spelled for part in case.split("-")))


def missing(refs: list[Reference]) -> list[str]:
    """What each reference that does not resolve lacks, as 'line: reference: why'."""
    problems = []
    for ref in refs:
        where = f"docs/security.md:{ref.line}: `{ref.text}`"
        if not ref.file.parts or ref.file.parts[0] != "tests" or not (ROOT / ref.file).is_file():
            others = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob(ref.file.name))
            problems.append(f"{where}: no file {ref.file} (files of that name: {others or 'none'})")
            continue
        if ref.name is None:
            continue
        function = _test_function(ref.file, ref.name)
        if function is None:
            problems.append(f"{where}: {ref.file} has no test {ref.name}")
        elif ref.case is not None and not _has_case(ref.file, function, ref.case):
            problems.append(f"{where}: {ref.file}::{ref.name} has no case [{ref.case}]")
    return problems


def test_every_test_the_security_page_names_exists() -> None:
    refs = references(DOC.read_text(encoding="utf-8"))
    assert len([r for r in refs if r.name]) >= 60, "the page's test references were not found: has their form changed?"
    problems = missing(refs)
    assert not problems, "docs/security.md names tests that do not exist:\n" + "\n".join(problems)


def test_every_test_of_test_security_py_is_named_by_the_page() -> None:
    named = {r.name for r in references(DOC.read_text(encoding="utf-8")) if r.file == BARE_FOLDER / "test_security.py"}
    tests = {
        node.name
        for node in _module(BARE_FOLDER / "test_security.py").body
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    }
    assert not tests - named, f"tests of test_security.py that docs/security.md does not name: {sorted(tests - named)}"


def test_the_resolver_follows_the_pages_rules() -> None:
    text = (
        "`test_security.py::test_a`, `::test_b[x-y]`,\n`tests/cache/test_nvme.py::test_c`, `::test_d`,"
        " `test_fuzz_index.py`, `loader/service/_arena.py`, `test_z.py::`"
    )
    assert [(r.line, str(r.file), r.name, r.case) for r in references(text)] == [
        (1, "tests/loader/test_security.py", "test_a", None),
        (1, "tests/loader/test_security.py", "test_b", "x-y"),
        (2, "tests/cache/test_nvme.py", "test_c", None),
        (2, "tests/cache/test_nvme.py", "test_d", None),
        (2, "tests/loader/test_fuzz_index.py", None, None),
    ]
    broken = missing(
        references(
            "`test_security.py::test_not_there`, `test_decode.py::test_x`,"
            " `tests/loader/decode/test_decode.py::test_bad_input_is_a_decode_error_with_its_reason"
            "[no-such-case]`"
        )
    )
    assert len(broken) == 3
    assert "has no test test_not_there" in broken[0]
    assert "no file tests/loader/test_decode.py" in broken[1] and "tests/loader/decode/test_decode.py" in broken[1]
    assert "has no case [no-such-case]" in broken[2]


def _claims(text: str) -> list[tuple[int, str]]:
    """The page's claims in §1 to §5: each top-level bullet (with its indented lines, blank lines between them
    included), and each table row of §5."""
    claims: list[tuple[int, str]] = []
    section, in_bullet = "", False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            section, in_bullet = line, False
        if not re.match(r"## §[1-5] ", section):
            continue
        if line.startswith("- ") or (section.startswith("## §5") and line.startswith("| ") and "`" in line):
            claims.append((number, line))
            in_bullet = line.startswith("- ")
        elif in_bullet and (line.startswith("  ") or not line.strip()):
            claims[-1] = (claims[-1][0], claims[-1][1] + "\n" + line)
        else:
            in_bullet = False
    return claims


def test_every_claim_of_the_security_page_names_its_test() -> None:
    text = DOC.read_text(encoding="utf-8")
    claims = _claims(text)
    assert len(claims) >= 25
    untested = [
        f"docs/security.md:{line}: {claim.splitlines()[0][:100]}"
        for line, claim in claims
        if not any(r.name for r in references(claim))
    ]
    assert not untested, "claims that name no test:\n" + "\n".join(untested)


def test_the_threat_model_says_who_the_adversary_is_and_what_a_same_user_process_can_do() -> None:
    model = DOC.read_text(encoding="utf-8").split("## Threat model", 1)[1].split("\n## ", 1)[0]
    model = " ".join(model.split())  # as wrapped anywhere
    assert "**Who the adversary is.** Other local, unprivileged users" in model
    assert "**A process of the same user**" in model and "can do anything the user can" in model
    assert "What omnifeed still guarantees against it" in model  # robustness, not secrecy: bounded, answered
    assert "Out of scope" in model and "Root" in model


# Suggestions a user must never get: opening up, or chmod-ing, a directory shared by every user of the node.
_SHARED = r"(?:/tmp|/dev/shm|\$TMPDIR|/var/tmp)\b"
_OPEN_SHARED = re.compile(rf"chmod\b[^\n]*{_SHARED}|{_SHARED}[^\n]*\bchmod\b|chmod\s+(?:-R\s+)?[0-7]*7{{2}}\b")


def test_no_page_or_message_suggests_chmod_on_a_shared_directory() -> None:
    places = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "examples").rglob("*")]
    for package in ("loader", "cache", "bucketing", "trainer_adapter", "tools"):
        places += [*(ROOT / package).rglob("*.py"), *(ROOT / package).rglob("*.md")]
    found = []
    for path in places:
        if path.is_file() and path.suffix in {".md", ".py", ".yaml", ".yml", ".sh", ".txt"}:
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if _OPEN_SHARED.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, (
        "a suggestion to chmod a shared directory (issue 23: suggest a private path instead):\n" + "\n".join(found)
    )
    assert _OPEN_SHARED.search("run `chmod 700 /tmp` first") and _OPEN_SHARED.search("chmod 777 $HOME/x")
