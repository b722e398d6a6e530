"""The pinned environment: requirements.txt, environment.yml and the lock agree."""
import re
from pathlib import Path

import pytest
import yaml

from kernels.testing import pinned_triton

ROOT = Path(__file__).resolve().parent.parent
PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s;]+)$")


def pins(lines) -> dict[str, str]:
    out = {}
    for raw in lines:
        line = raw.split("#")[0].strip()
        if not line:
            continue
        m = PIN.match(line)
        assert m, f"not an exact pin: {raw!r} (every dependency is pinned with ==)"
        out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def requirements() -> dict[str, str]:
    return pins((ROOT / "requirements.txt").read_text().splitlines())


def conda_pip() -> dict[str, str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pip_sections) == 1, "environment.yml needs exactly one pip section"
    return pins(pip_sections[0])


def test_environment_yml_names_the_same_versions_as_requirements():
    req, conda = requirements(), conda_pip()
    assert req == conda, (
        f"drift: only in requirements.txt {sorted(set(req.items()) - set(conda.items()))}, "
        f"only in environment.yml {sorted(set(conda.items()) - set(req.items()))}"
    )


def test_lock_agrees_with_requirements():
    lock = pins((ROOT / "requirements-lock.txt").read_text().splitlines())
    disagree = {k: (v, lock.get(k)) for k, v in requirements().items() if lock.get(k) != v}
    assert not disagree, f"requirements.txt and requirements-lock.txt disagree: {disagree}"


def test_the_contract_versions():
    req = requirements()
    assert req["torch"] == "2.13.0" and req["triton"] == "3.7.1"
    assert req["jupyter-book"].startswith("1.0."), "the course is built with Jupyter Book 1"
    assert req["jupyterlab"].startswith("4.")
    cuda = {k: v for k, v in req.items() if k.startswith("nvidia-")}
    assert {"nvidia-cuda-nvcc", "nvidia-cuda-cccl", "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm"} <= set(cuda)
    assert len({v.split(".")[0] for v in cuda.values()}) == 1, f"CUDA tools on more than one major: {cuda}"


# The packages `make compat` installs at another version (Makefile, COMPAT): torch 2.11 and triton 3.6 as
# on the lent GPUs, numpy below 2.4, and the CUDA runtime torch 2.11 pins for itself.
COMPAT_REPINNED = {"torch", "triton", "numpy", "nvidia-cuda-runtime"}


def test_installed_versions_match_the_pins():
    import importlib.metadata as md

    wrong = {}
    for name, version in requirements().items():
        if name in COMPAT_REPINNED and not pinned_triton():
            continue                                   # `make compat` installs the lent GPUs' versions of these
        installed = md.version(name)
        if installed.split("+")[0] != version:
            wrong[name] = (version, installed)
    assert not wrong, f"installed versions differ from requirements.txt (run `make env`): {wrong}"


def test_pins_reject_a_range():
    with pytest.raises(AssertionError, match="not an exact pin"):
        pins(["torch>=2.0"])


def test_syllabus_copy_matches_shared():
    shared = ROOT.parent / "shared" / "syllabus.yml"
    if not shared.is_file():
        pytest.skip("no ../shared/syllabus.yml beside this checkout to compare with")
    assert (ROOT / "syllabus.yml").read_text() == shared.read_text(), "syllabus.yml drifted from ../shared/syllabus.yml"
