"""The course map (``syllabus.yml``): parts, chapters, and the IDs notebooks carry."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SYLLABUS = ROOT / "syllabus.yml"


@lru_cache(maxsize=1)
def load() -> dict:
    return yaml.safe_load(SYLLABUS.read_text())


def parts() -> list[dict]:
    return load()["parts"]


def chapter_paths() -> dict[str, str]:
    """``{chapter id: notebook path relative to the root}`` for every chapter of every part."""
    paths = {}
    for part in parts():
        for ch in part["chapters"]:
            paths[ch["id"]] = f"{part['folder']}/{ch['id']}.ipynb"
    return paths
