"""The notebook rules: every book notebook is in the table of contents, carries its chapter ID,
was executed top to bottom, and holds no error output. (nbval then re-executes each one.)"""
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from tools import syllabus
from tools.notebooks import book_notebooks

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = book_notebooks()


def toc_files() -> set[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = set()

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                files.add(node["file"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(toc)
    return files


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_there_are_book_notebooks():
    assert NOTEBOOKS, "no notebooks under book/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=rel)
def test_notebook_is_in_the_table_of_contents(path):
    assert rel(path).removesuffix(".ipynb") in toc_files(), f"{rel(path)} is not in _toc.yml"


def test_every_toc_entry_exists():
    missing = [f for f in toc_files() if not any((ROOT / f).with_suffix(s).is_file() for s in (".ipynb", ".md"))]
    assert not missing, f"_toc.yml names files that do not exist: {missing}"


def chapter_problems(nb: dict, relpath: str) -> list[str]:
    chapter = nb.get("metadata", {}).get("course", {}).get("chapter")
    paths = syllabus.chapter_paths()
    if chapter not in paths:
        return [f"{relpath}: metadata course.chapter {chapter!r} is not a chapter ID of syllabus.yml"]
    if paths[chapter] != relpath:
        return [f"{relpath}: chapter {chapter!r} belongs at {paths[chapter]}"]
    return []


def execution_problems(nb: dict, relpath: str) -> list[str]:
    problems = []
    code = [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]
    counts = [c.get("execution_count") for c in code]
    if counts != list(range(1, len(code) + 1)):
        problems.append(f"{relpath}: execution counts {counts}: run `make execute`")
    for out in (o for c in code for o in c.get("outputs", [])):
        if out.get("output_type") == "error":
            problems.append(f"{relpath}: error output {out.get('ename')}: {out.get('evalue')}")
    if nb["metadata"].get("kernelspec", {}).get("name") != "python3":
        problems.append(f"{relpath}: kernelspec is not python3")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=rel)
def test_notebook_carries_its_chapter_id_at_its_syllabus_path(path):
    assert not chapter_problems(json.loads(path.read_text()), rel(path))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=rel)
def test_notebook_was_executed_top_to_bottom_without_errors(path):
    assert not execution_problems(json.loads(path.read_text()), rel(path))


def test_intro_lists_every_part_of_the_syllabus():
    intro = (ROOT / "intro.md").read_text()
    missing = [p["title"] for p in syllabus.parts() if p["title"] not in intro]
    assert not missing, f"intro.md does not list these parts: {missing}"


def test_the_rules_catch_a_bad_notebook():
    """The rules can fail: an out-of-order notebook with an error output and a wrong ID is refused."""
    bad = {"cells": [
        {"cell_type": "code", "source": "1", "execution_count": 2, "outputs": [], "metadata": {}},
        {"cell_type": "code", "source": "x", "execution_count": 1, "metadata": {},
         "outputs": [{"output_type": "error", "ename": "NameError", "evalue": "x", "traceback": []}]},
    ], "metadata": {"course": {"chapter": "softmax"}, "kernelspec": {"name": "ir"}}}
    problems = execution_problems(bad, "book/x.ipynb")
    assert len(problems) == 3 and "execution counts [2, 1]" in problems[0] and "NameError" in problems[1]
    assert "belongs at book/03-softmax/softmax.ipynb" in chapter_problems(bad, "book/x.ipynb")[0]
    bad["metadata"]["course"]["chapter"] = "no-such-chapter"
    assert "not a chapter ID" in chapter_problems(bad, "book/x.ipynb")[0]
    assert "book/x" not in toc_files()


def test_toc_is_generated_from_the_syllabus():
    from tools import toc

    assert (ROOT / "_toc.yml").read_text() == toc.render(), "_toc.yml is out of date: run `python -m tools.toc`"


def citation_problems(nb: dict, relpath: str) -> list[str]:
    """Chapters cite with {footcite} and end with a {footbibliography}: per-page references that
    never collide across pages (a {cite} key used on two pages is a duplicate citation)."""
    text = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    problems = []
    if re.search(r"\{cite(:[a-z]+)?\}|```\{bibliography\}", text):
        problems.append(f"{relpath}: uses {{cite}} or {{bibliography}}; use {{footcite}} and {{footbibliography}}")
    if "{footcite" in text and "{footbibliography}" not in text:
        problems.append(f"{relpath}: cites but has no {{footbibliography}}")
    keys = set(re.findall(r"\{footcite(?::[a-z]+)?\}`([^`]+)`", text))
    known = set(re.findall(r"^@\w+\{([^,]+),", (ROOT / "references.bib").read_text(), re.M))
    missing = {k.strip() for ks in keys for k in ks.split(",")} - known
    if missing:
        problems.append(f"{relpath}: cites keys missing from references.bib: {sorted(missing)}")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=rel)
def test_notebook_citations(path):
    assert not citation_problems(json.loads(path.read_text()), rel(path))


def test_citation_rules_can_fail():
    md = lambda s: {"cells": [{"cell_type": "markdown", "source": s}]}  # noqa: E731
    assert "use {footcite}" in citation_problems(md("see {cite}`x`"), "a")[0]
    assert "no {footbibliography}" in citation_problems(md("see {footcite}`tillet2019triton`"), "a")[0]
    assert "no-such-key" in citation_problems(md("{footcite}`no-such-key`\n```{footbibliography}\n```"), "a")[0]


def test_second_cpu_configuration_catches_a_machine_dependent_output(tmp_path):
    """The second pass can fail: a stored output that depends on the CPU configuration (here the
    thread count, as a raw error magnitude depends on the reduction order) passes on the reference
    configuration and fails under the second one."""
    import nbformat
    from tools.notebooks import run_nbval

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("import torch\nprint(torch.get_num_threads())", execution_count=1,
                                          outputs=[nbformat.v4.new_output("stream", name="stdout", text="1\n")])]
    path = tmp_path / "threads.ipynb"
    nbformat.write(nb, path)
    assert run_nbval(path).returncode == 0
    assert run_nbval(path, second_config=True).returncode != 0


def test_the_second_pass_of_make_test_catches_a_machine_dependent_output(tmp_path):
    """conftest.py's second pass (nbval's collector again, its kernel started under the second CPU
    configuration, in the same pytest process) fails a stored output that depends on the thread count,
    and passes the same notebook's first-configuration cells."""
    import subprocess
    import sys

    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("import torch\nprint(torch.get_num_threads())", execution_count=1,
                                          outputs=[nbformat.v4.new_output("stream", name="stdout", text="1\n")])]
    nbformat.write(nb, tmp_path / "threads.ipynb")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COURSE_", "PYTEST_"))}
    env.update(OMP_NUM_THREADS="1", COURSE_SECOND_PASS_UNDER=str(tmp_path), COURSE_AOT_LOG=str(tmp_path / "log"))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=",
         "-rA", "--nbval", "--nbval-current-env", str(tmp_path / "threads.ipynb")],
        capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert re.search(r"PASSED \S*threads\.ipynb::Cell 0", proc.stdout), proc.stdout[-3000:]
    assert re.search(r"FAILED \S*threads\.ipynb::second CPU configuration::Cell 0", proc.stdout), proc.stdout[-3000:]


def control_character_problems(nb: dict, relpath: str) -> list[str]:
    """A markdown cell holding a tab, form feed or backspace: LaTeX's \\text, \\frac or \\big written
    from a Python string without escaping, which MathJax cannot typeset."""
    bad = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\t]")
    return [f"{relpath}: markdown cell {i} holds {sorted(set(bad.findall(''.join(c['source']))))} (a backslash lost?)"
            for i, c in enumerate(nb["cells"]) if c["cell_type"] == "markdown" and bad.search("".join(c["source"]))]


def test_no_markdown_cell_holds_control_characters():
    problems = [p for path in NOTEBOOKS for p in control_character_problems(json.loads(path.read_text()), rel(path))]
    assert not problems, "\n".join(problems)
    md = {"cells": [{"cell_type": "markdown", "source": "$b_{\text{token}}$ and $\\frac{1}{2}$"}]}
    assert control_character_problems(md, "a") and "\\t" in repr(control_character_problems(md, "a")[0])


def test_references_bib_parses_as_the_book_build_reads_it():
    """sphinxcontrib-bibtex reads references.bib with pybtex; one unclosed entry stops the whole book
    build (the site test then fails far from the cause). Parse it here, and count its entries."""
    from pybtex.database import parse_file

    text = (ROOT / "references.bib").read_text()
    entries = parse_file(str(ROOT / "references.bib")).entries
    assert len(entries) == len(re.findall(r"^@\w+\{", text, re.M))


TEST_PATH = re.compile(r"\btests/[\w/.-]+?\.py\b")


def missing_test_files(nb: dict, relpath: str) -> list[str]:
    """A chapter that says where it is checked ("Checked here and in `tests/test_x.py`") names a file
    that must exist: every tests/....py path in a cell's source."""
    named = {m for c in nb["cells"] for m in TEST_PATH.findall("".join(c["source"]))}
    return [f"{relpath}: names {p}, which does not exist" for p in sorted(named) if not (ROOT / p).is_file()]


def test_every_test_file_a_notebook_names_exists():
    problems = [p for path in NOTEBOOKS for p in missing_test_files(json.loads(path.read_text()), rel(path))]
    assert not problems, "\n".join(problems)


def test_missing_test_file_rule_can_fail():
    md = lambda s: {"cells": [{"cell_type": "markdown", "source": s}]}  # noqa: E731
    assert missing_test_files(md("Checked in `tests/test_notebooks.py` and tests/test_pipeline.py."), "a") == []
    problems = missing_test_files(md("Checked here and in `tests/test_never_written.py::test_x`."), "a")
    assert problems == ["a: names tests/test_never_written.py, which does not exist"]
