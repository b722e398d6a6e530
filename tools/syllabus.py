"""The course map (``syllabus.yml``): parts, chapters, and the IDs notebooks carry."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SYLLABUS = ROOT / "syllabus.yml"
# The start chapter comes before the syllabus's parts and has an ID of its own.
START_CHAPTERS = {"how-kernels-run": "book/00-start/how-kernels-run.ipynb"}


@lru_cache(maxsize=1)
def load() -> dict:
    return yaml.safe_load(SYLLABUS.read_text())


def parts() -> list[dict]:
    return load()["parts"]


def chapter_paths() -> dict[str, str]:
    """``{chapter id: notebook path relative to the root}`` for every chapter, the start chapter included."""
    paths = dict(START_CHAPTERS)
    for part in parts():
        for ch in part["chapters"]:
            paths[ch["id"]] = f"{part['folder']}/{ch['id']}.ipynb"
    return paths
