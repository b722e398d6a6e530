"""Labs: notebooks with stubs, solutions kept beside them, and checks that must catch wrong answers.

A lab ``labs/<part>/<lab>.ipynb`` marks its cells in metadata:

* a **task** cell (``{"lab": {"task": NAME}}``) holds the learner's stub: a TODO and
  ``raise NotImplementedError``;
* a **check** cell (``{"lab": {"check": NAME}}``) compares the learner's function with the
  reference (``kernels.testing.check_cases``) and prints the first mismatches when it differs.

Its solutions live in ``labs/solutions/<lab>.py`` (outside the rendered book), as blocks::

    # %% solution NAME
    <the code that solves task NAME>
    # %% wrong NAME: the slip it models | hint: words the check's report must contain
    <a plausible mistake that the check for NAME must reject>

CI runs each lab with every task solved (under nbval), and once per wrong block with that one
task replaced by the mistake, expecting the matching check cell, and no other, to fail, and its
report to contain the block's hint: the check names the slip in the mechanism's terms
(``kernels.testing.check_cases(..., hints=...)``), not only the tensor that differs. Every task has
a wrong block that calls the course's reference for it; its check runs the learner's function with
those references refused (``check_cases(..., refuse=...)``, ``kernels.testing.own``), so the hint of
that block is the refusal's "write it yourself". A library function that is the task's answer in one
call (``torch.softmax``) is refused the same way, named by its dotted path in ``refuse=``. Triton
kernels run bounds-checked (``kernels.testing.bounds_checked``), so a wrong block may also model an
unmasked lane whose value never shows in the result; a launcher the learner writes is checked with
``kernels.testing.launching``, so one that computes the result in PyTorch instead of launching the
kernel fails.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
LABS = ROOT / "labs"
SOLUTIONS = LABS / "solutions"
_BLOCK = re.compile(r"^# %% (solution|wrong) ([\w-]+)(?::\s*(.*?))?(?:\s*\|\s*hint:\s*(.*))?$")
BORROWED = "write it yourself"  # the hint of a block that calls the course's reference


@dataclass(frozen=True)
class Block:
    kind: str  # "solution" or "wrong"
    task: str
    source: str
    why: str = ""  # for a wrong block: the slip it models
    hint: str = ""  # for a wrong block: what its check's report must say about that slip


def lab_notebooks() -> list[Path]:
    return sorted(p for p in LABS.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts and "solutions" not in p.parts)


def solutions_path(lab: Path) -> Path:
    return SOLUTIONS / f"{lab.stem}.py"


def load_blocks(path: Path) -> list[Block]:
    """Parse a solutions file into its blocks, in order."""
    blocks: list[Block] = []
    header, lines = None, []

    def flush():
        if header:
            kind, task, why, hint = header
            blocks.append(Block(kind, task, "\n".join(lines).strip("\n") + "\n", why or "", hint or ""))

    for line in path.read_text().splitlines():
        m = _BLOCK.match(line)
        if m:
            flush()
            header, lines = m.groups(), []
        elif header:
            lines.append(line)
    flush()
    return blocks


def tasks(nb) -> dict[str, int]:
    """``{task name: cell index}`` of the task cells."""
    return {c.metadata["lab"]["task"]: i for i, c in enumerate(nb.cells) if "task" in c.metadata.get("lab", {})}


def checks(nb) -> dict[str, int]:
    """``{task name: cell index}`` of the check cells."""
    return {c.metadata["lab"]["check"]: i for i, c in enumerate(nb.cells) if "check" in c.metadata.get("lab", {})}


def solved(nb, blocks: list[Block], *, wrong: Block | None = None):
    """A copy of ``nb`` with every task cell replaced by its solution (and ``wrong`` in its task's place)."""
    out = copy.deepcopy(nb)
    solutions = {b.task: b for b in blocks if b.kind == "solution"}
    for task, index in tasks(out).items():
        if task not in solutions:
            raise KeyError(f"no solution block for task {task!r}")
        chosen = wrong if wrong is not None and wrong.task == task else solutions[task]
        out.cells[index].source = chosen.source
    for cell in out.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return out


def for_nbval(nb):
    """Mark every code cell ``nbval-ignore-output``: a lab's stored notebook has no outputs to compare,
    so under nbval a solved lab passes when every cell runs without error."""
    out = copy.deepcopy(nb)
    for cell in out.cells:
        if cell.cell_type == "code":
            tags = cell.metadata.setdefault("tags", [])
            if "nbval-ignore-output" not in tags:
                tags.append("nbval-ignore-output")
    return out


def read(path: Path):
    return nbformat.read(path, as_version=4)
