"""Labs: with their solutions swapped in they run cleanly under nbval, and every check cell
rejects the known-wrong implementations kept beside the solutions, naming the slip each one models;
an answer that calls the course's reference is refused ("write it yourself")."""
import copy
import subprocess
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from tools import labs, notebooks

ROOT = Path(__file__).resolve().parent.parent
LABS = labs.lab_notebooks()
WRONG = [(lab, block) for lab in LABS if labs.solutions_path(lab).is_file()
         for block in labs.load_blocks(labs.solutions_path(lab)) if block.kind == "wrong"]


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def run_under_nbval(nb, folder: Path, *, both: bool = False) -> subprocess.CompletedProcess:
    path = folder / "solved.ipynb"
    nbformat.write(labs.for_nbval(nb), path)
    return notebooks.run_nbval(path, both=both)


def failing_cell(nb, folder: Path):
    """Execute ``nb``; return (index, ename) of the cell that raised, or None if all ran."""
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(folder)}})
    try:
        client.execute()
    except CellExecutionError:
        for i, cell in enumerate(nb.cells):
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error":
                    return i, out["ename"]
        raise
    return None


@pytest.mark.parametrize("lab", LABS, ids=rel)
def test_lab_is_a_set_of_stubs_with_checks_and_solutions(lab):
    nb = labs.read(lab)
    tasks, checks = labs.tasks(nb), labs.checks(nb)
    assert tasks, f"{rel(lab)} has no task cells"
    assert set(tasks) == set(checks), f"tasks {sorted(tasks)} and checks {sorted(checks)} differ"
    for task, i in tasks.items():
        src = nb.cells[i].source
        assert "TODO" in src and "raise NotImplementedError" in src, f"task {task} is not a stub"
        assert checks[task] > i, f"the check for {task} comes before its task"
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "labs are stored without outputs"
    blocks = labs.load_blocks(labs.solutions_path(lab))
    for task in tasks:
        kinds = {b.kind for b in blocks if b.task == task}
        assert kinds == {"solution", "wrong"}, f"task {task} needs a solution and at least one wrong block"
        wrong = [b for b in blocks if b.task == task and b.kind == "wrong"]
        assert all(b.why and b.hint for b in wrong), f"task {task}: every wrong block declares its slip and the hint its check prints"
        assert any(b.hint == labs.BORROWED for b in wrong), f"task {task} has no wrong block that borrows the course's reference"


@pytest.mark.parametrize("lab", LABS, ids=rel)
def test_solved_lab_runs_under_nbval_in_both_cpu_configurations(lab, tmp_path):
    """Solved, a lab runs cleanly, and its checks pass under both CPU configurations (one pytest
    process: nbval's cells, then the same cells again in a kernel started under the second one)."""
    solved = labs.solved(labs.read(lab), labs.load_blocks(labs.solutions_path(lab)))
    proc = run_under_nbval(solved, tmp_path, both=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    cells = sum(c.cell_type == "code" for c in solved.cells)
    assert f"{2 * cells} passed" in proc.stdout.splitlines()[-1], f"not every cell ran in both configurations:\n{proc.stdout[-2000:]}"


class LabKernel:
    """One kernel for all of a lab's known-wrong blocks (a kernel start and the lab's set-up cells
    once, not once per block). The solved lab runs in order; a wrong block is tried in its task's
    cell, followed by the cells up to that task's check, exactly as a fresh run of the lab with that
    block would reach them; then the solution and the same cells run again, so the next block starts
    from the solved state."""

    def __init__(self, lab: Path, folder: Path):
        self.lab = lab
        self.nb = labs.read(lab)
        self.solved = labs.solved(self.nb, labs.load_blocks(labs.solutions_path(lab)))
        # the client keeps its own copy: execute_cell stores each executed cell into the client's notebook
        self.client = NotebookClient(copy.deepcopy(self.solved), timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(folder)}})
        self._kernel = self.client.setup_kernel()
        self._kernel.__enter__()
        self.done = 0                          # cells of the solved lab executed so far

    def run_solved(self, stop: int) -> None:
        """Execute the solved lab's cells up to (not including) ``stop``; one that raises fails the test."""
        for i in range(self.done, stop):
            self.client.execute_cell(self.solved.cells[i], i)
        self.done = max(self.done, stop)

    def try_wrong(self, block):
        """(index, ename, message) of the cell that raised with ``block`` in its task's cell, or None."""
        task, check = labs.tasks(self.nb)[block.task], labs.checks(self.nb)[block.task]
        self.run_solved(task)
        failure = None
        self.client.allow_errors = True        # an error must not make the kernel abort what follows
        try:
            for i in range(task, check + 1):
                cell = copy.deepcopy(self.solved.cells[i])
                if i == task:
                    cell.source = block.source
                self.client.execute_cell(cell, i)
                errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
                if errors:
                    failure = (i, errors[0]["ename"], errors[0]["evalue"])
                    break
        finally:
            self.client.allow_errors = False
        for i in range(task, check + 1):       # back to the solved state
            self.client.execute_cell(copy.deepcopy(self.solved.cells[i]), i)
        self.done = max(self.done, check + 1)
        return failure

    def close(self) -> None:
        self._kernel.__exit__(None, None, None)


@pytest.fixture(scope="module")
def lab_kernels(tmp_path_factory):
    """The kernel of the lab whose wrong blocks are being tried (one at a time: the previous lab's
    kernel stops when the next lab's first block comes)."""
    open_kernels: dict[Path, LabKernel] = {}

    def get(lab: Path) -> LabKernel:
        if lab not in open_kernels:
            for other in list(open_kernels):
                open_kernels.pop(other).close()
            open_kernels[lab] = LabKernel(lab, tmp_path_factory.mktemp(lab.stem))
        return open_kernels[lab]

    yield get
    for kernel in open_kernels.values():
        kernel.close()


@pytest.mark.parametrize("lab, block", WRONG, ids=[f"{lab.stem}:{b.task}:{b.why}" for lab, b in WRONG])
def test_check_rejects_a_known_wrong_implementation(lab, block, lab_kernels):
    failure = lab_kernels(lab).try_wrong(block)
    assert failure is not None, f"the check for {block.task} accepted the wrong implementation ({block.why})"
    index, ename, message = failure
    assert index == labs.checks(labs.read(lab))[block.task], f"cell {index} failed, not the check for {block.task}"
    assert ename in ("MismatchError", "AssertionError", "BorrowedReference", "OutOfBounds"), f"the check failed with {ename}, not a mismatch"
    assert block.hint in message, f"the check's report does not name the slip ({block.why}): wanted {block.hint!r} in\n{message}"
    if block.hint == labs.BORROWED:
        assert ename == "BorrowedReference", f"a borrowed answer failed with {ename}, not as borrowed"


def test_the_mechanism_on_a_tiny_lab(tmp_path):
    """The harness itself can fail: a wrong block that the check misses is reported."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import torch\nfrom kernels.testing import check_cases"),
        nbformat.v4.new_code_cell("def double(x):\n    # TODO\n    raise NotImplementedError", metadata={"lab": {"task": "double"}}),
        nbformat.v4.new_code_cell("print(check_cases(double, lambda x: 2 * x, [torch.ones(3)]))", metadata={"lab": {"check": "double"}}),
    ]
    sol = tmp_path / "tiny.py"
    sol.write_text("# %% solution double\ndef double(x):\n    return x + x\n"
                   "# %% wrong double: squares\ndef double(x):\n    return x * x\n"
                   "# %% wrong double: adds one\ndef double(x):\n    return x + 1\n")
    blocks = labs.load_blocks(sol)
    assert [(b.kind, b.why) for b in blocks] == [("solution", ""), ("wrong", "squares"), ("wrong", "adds one")]
    assert run_under_nbval(labs.solved(nb, blocks), tmp_path).returncode == 0
    assert failing_cell(labs.solved(nb, blocks, wrong=blocks[1]), tmp_path) == (2, "MismatchError")
    assert failing_cell(labs.solved(nb, blocks, wrong=blocks[2]), tmp_path) is None  # x + 1 == 2x on ones: a weak check lets it pass


def test_the_labs_index_lists_every_lab_with_its_time():
    """labs/README.md, the page the labs open on, links every lab and gives its time on one core."""
    index = (labs.LABS / "README.md").read_text()
    rows = {line.split("](")[1].split(")")[0]: line for line in index.splitlines() if line.startswith("|") and "](" in line}
    for lab in LABS:
        link = lab.relative_to(labs.LABS).as_posix()
        assert link in rows, f"labs/README.md does not list {link}"
        assert rows[link].rstrip(" |").endswith(" s"), f"labs/README.md gives no time for {link}"
    assert len(rows) == len(LABS), f"labs/README.md lists labs that do not exist: {sorted(set(rows) - {l.relative_to(labs.LABS).as_posix() for l in LABS})}"
