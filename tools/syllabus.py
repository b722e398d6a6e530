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


# The package of ``kernels`` that holds each part's mechanisms (one module per mechanism, the PyTorch
# reference beside the kernel). A part whose chapters are not written yet may have no package yet;
# the start chapter teaches with the gemm and ptx packages.
KERNEL_PACKAGES = {
    "start": None,
    "foundations": "model",
    "gpu": "gpu",
    "softmax": "softmax",
    "norm": "norm",
    "mlp": "mlp",
    "position": "position",
    "attention": "attention",
    "kv-cache": "kvcache",
    "quantization": "quant",
    "speculative": "speculative",
    "serving": "serving",
    "rl": "rl",
    "gemm": "gemm",
    "ptx": "ptx",
    "distributed": "dist",
    "moe": "moe",
}
# Modules at the top of ``kernels`` that serve every part: the device, the checks, compilation,
# its shared build cache, timing, the bytes of live tensors (a measuring tool that parts 01 and 11 use),
# the row-kernel layout helpers and the CUDA driver loader.
INFRASTRUCTURE_MODULES = {"runtime", "testing", "inspect", "aot_cache", "bench", "tensor_memory", "rows", "cuda_launch"}
