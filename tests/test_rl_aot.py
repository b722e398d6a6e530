"""Ahead-of-time compiles of the kernels.rl kernels for sm_90a at real sizes: no spills, 64-bit offsets."""
import kernels  # noqa: F401  (before triton)
import pytest

from kernels import inspect as ki
from kernels.rl import gae, grpo, logprobs, ppo, preference

VOCABS = (128_256, 151_936)      # Llama 3, Qwen 2.5


@pytest.fixture(scope="module")
def builds():
    jobs = {f"logprob grad {dt} V={V}": logprobs.aot_job(V, dt) for V in VOCABS for dt in ("fp32", "bf16")}
    jobs.update({f"ppo {kl}": ppo.aot_job(kl) for kl in ppo.KL_ESTIMATORS})
    jobs["ppo k3, no value"] = ppo.aot_job("k3", value=False)
    jobs.update({f"preference {k}": preference.aot_job(k) for k in preference.KINDS})
    jobs["group advantages G=16"] = grpo.aot_job(16)
    jobs["gae"] = gae.aot_job()
    out = ki.compile_triton_many(list(jobs.values()))
    return {name: b["sm90"] for name, b in zip(jobs, out)}


def test_no_kernel_spills_on_sm90(builds):
    for name, b in builds.items():
        assert b.spills == 0 and b.metadata["stack_bytes"] == 0, ki.resource_table([(name, b)])
        assert b.metadata["registers"] <= 128, (name, b.metadata["registers"])


def test_logprob_row_offset_is_64_bit(builds):
    """row * stride passes 2**31 at V = 128256 from row 16744 on: the PTX must form it in 64 bits."""
    ptx = builds["logprob grad fp32 V=128256"].ptx
    assert "mul.wide.s32" in ptx or "mul.lo.s64" in ptx
