"""docs/migrating.md's line-by-line port of the MultiWorkerMirroredStrategy tutorial: its counts are its
diff's, and its port is the code ``mpistrat/examples/multi_worker.py`` runs."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "migrating.md").read_text()
EXAMPLE = (ROOT / "mpistrat" / "examples" / "multi_worker.py").read_text()

# The example's command line sets these of the tutorial's lines; `import mnist` is the module itself.
SET_BY_THE_COMMAND_LINE = {
    "import mnist",
    "per_worker_batch_size = 64",
    "num_epochs = 3",
    "num_steps_per_epoch=70",
    "checkpoint_dir = os.path.abspath('ckpt')",
    "strategy = mpistrat.MultiWorkerMirroredStrategy()",
}

pytestmark = pytest.mark.serial("reads files only")


def _diff() -> list[str]:
    section = PAGE[PAGE.index("## A multi-worker program, line by line") :]
    block = re.search(r"```diff\n(.*?)\n\s*```", section, re.S)
    assert block, "no diff block in the multi-worker section"
    return [line[4:] if line.startswith("    ") else line for line in block[1].splitlines()]


def _code(lines: list[str], mark: str) -> list[str]:
    return [line[1:] for line in lines if line[:1] == mark and line[1:].strip()]


def _normal(text: str) -> str:
    """Whitespace, quote style and trailing commas aside, which the formatter chooses."""
    text = re.sub(r"\s+", "", text).replace("'", '"')
    return text.replace(",)", ")").replace(",]", "]")


def test_the_counts_on_the_page_are_its_diffs():
    lines = _diff()
    same, removed, added = (len(_code(lines, m)) for m in (" ", "-", "+"))
    stated = re.search(
        r"Of its (\d+) lines of code \(blank lines aside\), \*\*(\d+) stay as they are\*\*; (\d+) change, "
        r"and the\s+port has (\d+) lines in their place",
        PAGE,
    )
    assert stated, "the sentence with the counts is missing"
    assert [int(n) for n in stated.groups()] == [same + removed, same, removed, added]
    table = PAGE[PAGE.index("What the 33 lines are") : PAGE.index("`train_accuracy.reset_states()`")]
    rows = [int(m) for m in re.findall(r"^\| (\d+) \|", table, re.M)]
    assert sum(rows) == removed, rows


def test_every_line_of_the_port_is_in_the_example():
    source = _normal(EXAMPLE)
    port = _code(_diff(), "+") + _code(_diff(), " ")
    missing = [
        line for line in port if line.strip() not in SET_BY_THE_COMMAND_LINE and _normal(line) not in source
    ]
    assert missing == []


def test_the_tutorials_lines_are_gone_from_the_example():
    source = _normal(EXAMPLE)
    kept = [line for line in _code(_diff(), "-") if "tf." in line]
    assert kept and not [line for line in kept if _normal(line) in source]


def test_mirrored_strategy_is_an_error_that_names_mpistrategy():
    import mpistrat

    with pytest.raises(AttributeError, match=r"mpistrat\.MPIStrategy\(\).*one rank per device"):
        mpistrat.MirroredStrategy  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'NoSuchStrategy'"):
        mpistrat.NoSuchStrategy  # noqa: B018


def test_the_optimizer_tables_answer_for_every_keras_optimizer_and_argument():
    """Every public name of Keras 3's ``keras.optimizers`` and ``schedules``, and every argument of
    its base ``Optimizer`` (recorded from Keras itself with the optimizer fixtures) has its row."""
    import json

    names = json.loads((ROOT / "tests" / "training" / "data" / "keras_optimizers.json").read_text())["names"]
    section = PAGE[PAGE.index("### Optimizers (Keras 3)") : PAGE.index("### StrategyExtended")]
    rows = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| `")]
    listed = set(re.findall(r"\w+", " ".join(rows)))  # the words of the rows' first column
    wanted = set(names["optimizers"]) | set(names["schedules"]) | set(names["arguments"])
    assert sorted(wanted - listed) == []
