"""Each stage's README states its public contract with one runnable example: the examples run as written (doctest).

Only public names are used in them (a stage's ``__init__`` is its contract), so an example that stops working is a
contract that changed.
"""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGE_READMES = [
    "loader/index/README.md",
    "loader/decode/README.md",
    "loader/plan/README.md",
    "loader/feed/README.md",
    "loader/service/README.md",
    "loader/dataloader/README.md",
    "cache/README.md",
    "bucketing/README.md",
]


def contract_examples(readme: Path) -> list[str]:
    """The README's ``pycon`` blocks under its "Contract" heading."""
    text = readme.read_text(encoding="utf-8")
    section = text.split("## Contract", 1)[1].split("\n## ", 1)[0] if "## Contract" in text else ""
    return re.findall(r"```pycon\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize("readme", STAGE_READMES)
def test_the_stage_readme_states_its_contract_with_an_example(readme: str) -> None:
    assert contract_examples(ROOT / readme), f"{readme} has no '## Contract' section with a pycon example"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("readme", STAGE_READMES)
def test_the_contract_example_runs_as_written(readme: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # tempfile.mkdtemp() in the examples: under this test's directory
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report: list[str] = []  # doctest replaces sys.stdout while it runs: its report is collected, not printed
    for number, example in enumerate(contract_examples(ROOT / readme)):
        runner.run(parser.get_doctest(example, {}, f"{readme}[{number}]", readme, 0), out=report.append)
    results = runner.summarize(verbose=False)
    failed = f"{readme}'s example, {results.failed} of {results.attempted} failed:\n"
    assert results.failed == 0, failed + "".join(report)
