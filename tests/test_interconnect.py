"""kernels.gpu.interconnect: every link's per-direction figure agrees with the number quoted from
its source, every source is in references.bib, and the systems' alpha-beta predictions."""
import math
import re
from pathlib import Path

import pytest

from kernels.dist import cost_model as cm
from kernels.gpu import interconnect as ic

BIB = (Path(__file__).resolve().parent.parent / "references.bib").read_text()


def test_table_agrees_with_its_sources():
    assert ic.table_problems() == []
    assert ic.link("nvlink4").gbs_per_direction == 450 and ic.link("nvlink5").gbs_per_direction == 900
    assert ic.link("ndr").gbs_per_direction == 50
    assert math.isclose(ic.link("pcie5").gbs_per_direction, 63.015, rel_tol=1e-4)


def test_a_bidirectional_figure_stored_as_one_direction_is_caught():
    bad = dict(ic.LINKS)
    bad["nvlink4"] = ic.Link("nvlink4", "NVLink 4", "nvlink", "H100", 900, "900 GB/s bidirectional", "x")
    bad["ndr"] = ic.Link("ndr", "NDR", "infiniband", "", 400, "400 Gb/s per port", "x")
    problems = ic.table_problems(bad)
    assert len(problems) == 2 and "not half of 900 GB/s" in problems[0] and "not 400 Gb/s per port / 8" in problems[1]


def test_every_source_is_cited_in_references_bib():
    keys = {l.source for l in ic.LINKS.values()} | {s.source for s in ic.SYSTEMS.values()}
    keys |= {k for _, k in ic.DATASHEET_TOTALS_GBS.values()} | {"nvidia2020nccltuning", "nvidia2020ncclmultinic"}
    missing = [k for k in keys if not re.search(r"@\w+\{" + re.escape(k) + ",", BIB)]
    assert not missing, missing


def test_unknown_keys():
    with pytest.raises(KeyError, match="unknown link 'nvlink9'"):
        ic.link("nvlink9")
    with pytest.raises(KeyError, match="unknown system"):
        ic.system("DGX-9")


def test_dgx_h100_all_reduce_prediction():
    dgx, pcie = ic.system("DGX H100"), ic.system("8x H100 PCIe, no NVLink")
    n = 1e9                                                 # 1 GB
    t = cm.predict_system(dgx, "ring", n, with_base=False)
    assert math.isclose(t, 14 * 3.4e-6 + 1.75e9 / 450e9)
    assert cm.predict_system(pcie, "ring", n) / cm.predict_system(dgx, "ring", n) > 7   # 450 / 63 GB/s
    # busbw of the predicted time, at large n, approaches the link rate
    algbw = n / t / 1e9
    assert 440 < cm.bus_bandwidth_gbs(algbw, 8) < 450
    with pytest.raises(ValueError, match="collective must be one of"):
        cm.bus_bandwidth_gbs(1.0, 8, "broadcast")


def test_rails_spread_the_network_share_over_every_nic():
    """One ring of 16 GPUs is held to one NIC's 50 GB/s; 8 rings, each through another of a node's 8
    NICs, carry 1/8 of each GPU's bytes over its NIC and 7/8 over NVLink: min(8 x 50, 8/7 x 450) GB/s."""
    one, rails = ic.system("2x DGX H100, one ring"), ic.system("2x DGX H100, 8 rails")
    assert math.isclose(1 / one.beta_s_per_byte, 50e9)
    assert math.isclose(1 / rails.beta_s_per_byte, 400e9)
    four = ic.System("TP 8 over two nodes", 8, "ndr", "", "", rails=4, intra="nvlink4")
    assert math.isclose(1 / four.beta_s_per_byte, 200e9)          # 4 NICs: 4 x 50 < 4/3 x 450
    with pytest.raises(ValueError, match="needs intra"):
        ic.System("bad", 16, "ndr", "", "", rails=8)

