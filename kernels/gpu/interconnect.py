"""The wires between GPUs, with every number's source: NVLink by generation, PCIe x16 by
generation, InfiniBand and Ethernet (RoCE) ports, and three systems built from them.

Units: ``gbs_per_direction`` is GB/s (1e9 bytes per second) that one GPU can send while it
receives as much. Datasheets quote NVLink as the two directions added ("900 GB/s" for an H100 is
450 GB/s each way over 18 links of 50 GB/s, i.e. 25 GB/s each way per link); network ports are
quoted in Gb/s per direction (bits: "400 Gb/s" NDR is 50 GB/s each way). The table stores one
direction, the figure that bounds a ring, and each :class:`Link` keeps the quoted number too, so
the test can check the conversion against the source's own words.

Sources (keys in ``references.bib``):

* NVLink generations and links per GPU: the product datasheets (P100 whitepaper, V100, A100,
  H100) and NVIDIA's NVLink page for the fifth generation (``nvidia2024nvlinkpage``);
* PCIe: the PCI-SIG base specifications give the per-lane rate (8, 16, 32 GT/s for Gen3-5) and
  the 128b/130b encoding; the A100 and H100 datasheets quote the resulting 64 and 128 GB/s
  (two directions, x16);
* InfiniBand HDR/NDR/XDR per port: NVIDIA's ConnectX-6/7/8 adapter pages (``nvidia2024connectx``);
  400 Gb/s Ethernet (RoCE on the same ConnectX-7 adapter): IEEE 802.3bs-2017;
* the DGX H100 system (8 H100 SXM, 4 NVSwitch chips, 8 ConnectX-7 400 Gb/s ports for the compute
  fabric): the DGX H100 user guide (``nvidia2023dgxh100guide``);
* per-step latencies: NCCL's own tuning model, ``hwLat`` for the ring with its Simple protocol,
  3.4 us over NVLink, 5.7 us over PCIe, 9.6 us over the network, plus a base latency of 8.4 us
  per call (``nvidia2020nccltuning``, a pinned commit of src/graph/tuning.cc).
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("nvlink", "pcie", "infiniband", "ethernet")


@dataclass(frozen=True)
class Link:
    key: str                      # "nvlink4", "pcie5", "ndr" ...
    name: str
    kind: str                     # one of KINDS
    gpu: str                      # the GPU generation that introduced it ("" for networks)
    gbs_per_direction: float      # GB/s one GPU (or port) sends while receiving as much
    quoted: str                   # the number as the source prints it
    source: str                   # citation key in references.bib


def pcie_x16_gbs(gt_per_s: float, payload_bits: int = 128, line_bits: int = 130) -> float:
    """GB/s per direction of a x16 link: 16 lanes * rate (GT/s, one bit per transfer) * encoding / 8."""
    return 16 * gt_per_s * payload_bits / line_bits / 8


def _nvlink(key, name, gpu, links, total_gbs, source):
    # total_gbs: the datasheet's "both directions added" figure; one direction is half of it
    return Link(key, f"{name} ({links} links)", "nvlink", gpu, total_gbs / 2, f"{total_gbs:g} GB/s bidirectional", source)


def _port(key, name, kind, gbit, source):
    return Link(key, name, kind, "", gbit / 8, f"{gbit:g} Gb/s per port", source)


LINKS: dict[str, Link] = {l.key: l for l in [
    _nvlink("nvlink1", "NVLink 1", "P100", 4, 160, "nvidia2016p100whitepaper"),
    _nvlink("nvlink2", "NVLink 2", "V100", 6, 300, "nvidia2017v100datasheet"),
    _nvlink("nvlink3", "NVLink 3", "A100", 12, 600, "nvidia2021a100datasheet"),
    _nvlink("nvlink4", "NVLink 4", "H100", 18, 900, "nvidia2023h100datasheet"),
    _nvlink("nvlink5", "NVLink 5", "B200", 18, 1800, "nvidia2024nvlinkpage"),
    Link("pcie3", "PCIe Gen3 x16", "pcie", "", pcie_x16_gbs(8), "8 GT/s per lane, 128b/130b", "pcisig2025specs"),
    Link("pcie4", "PCIe Gen4 x16", "pcie", "A100", pcie_x16_gbs(16), "16 GT/s per lane, 128b/130b", "pcisig2025specs"),
    Link("pcie5", "PCIe Gen5 x16", "pcie", "H100", pcie_x16_gbs(32), "32 GT/s per lane, 128b/130b", "pcisig2025specs"),
    _port("hdr", "InfiniBand HDR (ConnectX-6)", "infiniband", 200, "nvidia2024connectx"),
    _port("ndr", "InfiniBand NDR (ConnectX-7)", "infiniband", 400, "nvidia2024connectx"),
    _port("xdr", "InfiniBand XDR (ConnectX-8)", "infiniband", 800, "nvidia2024connectx"),
    _port("400gbe", "400 Gb/s Ethernet, RoCE (ConnectX-7)", "ethernet", 400, "ieee2017ethernet400g"),
]}

# Datasheet totals per GPU the tests check the table against (both directions, x16 for PCIe).
DATASHEET_TOTALS_GBS = {"pcie4": (64, "nvidia2021a100datasheet"), "pcie5": (128, "nvidia2023h100datasheet")}

# NCCL's tuning model (src/graph/tuning.cc, pinned): per-step hardware latency of a ring with the
# Simple protocol, by the kind of hop, and the base latency of one call, in microseconds.
NCCL_RING_STEP_US = {"nvlink": 3.4, "pcie": 5.7, "network": 9.6}
NCCL_BASE_US = 8.4
_STEP_KIND = {"nvlink": "nvlink", "pcie": "pcie", "infiniband": "network", "ethernet": "network"}


def link(key: str) -> Link:
    if key not in LINKS:
        raise KeyError(f"unknown link {key!r}; known: {', '.join(LINKS)}")
    return LINKS[key]


@dataclass(frozen=True)
class System:
    """GPUs joined in rings whose slowest hop is ``bottleneck``, and every ring step pays NCCL's
    per-step latency for that hop.

    ``rails = 1``: one ring, every GPU sends all its bytes through the bottleneck at its
    per-direction bandwidth. ``rails = r > 1`` (GPUs of a node on ``intra`` links, r NICs per node):
    NCCL runs r rings (channels) at once, each entering and leaving a node through a different NIC
    and crossing the node's other GPUs over ``intra`` (nvidia2020ncclmultinic). Each GPU then leaves
    its node in one ring of r, so 1/r of its bytes cross its NIC and the rest cross ``intra``; the
    slower of the two sets the time per byte."""
    key: str
    gpus: int
    bottleneck: str               # a key of LINKS
    note: str
    source: str
    rails: int = 1
    intra: str | None = None      # a key of LINKS, required when rails > 1

    def __post_init__(self):
        if self.rails < 1 or (self.rails > 1) != (self.intra is not None):
            raise ValueError(f"System {self.key!r}: rails={self.rails} needs intra set exactly when rails > 1")

    @property
    def beta_s_per_byte(self) -> float:
        net = link(self.bottleneck).gbs_per_direction * 1e9
        if self.rails == 1:
            return 1.0 / net
        inside = link(self.intra).gbs_per_direction * 1e9
        return max(1 / (self.rails * net), (self.rails - 1) / (self.rails * inside))   # NIC share vs NVLink share

    @property
    def alpha_s(self) -> float:
        return NCCL_RING_STEP_US[_STEP_KIND[link(self.bottleneck).kind]] * 1e-6


SYSTEMS: dict[str, System] = {s.key: s for s in [
    System("DGX H100", 8, "nvlink4",
           "8 H100 SXM on 4 NVSwitch chips: every GPU reaches every other at its full NVLink rate",
           "nvidia2023dgxh100guide"),
    System("8x H100 PCIe, no NVLink", 8, "pcie5",
           "each GPU on its own PCIe Gen5 x16 link; best case: no shared switch or CPU link slower than x16",
           "nvidia2023h100datasheet"),
    System("2x DGX H100, one ring", 16, "ndr",
           "16 GPUs in one flat ring: its two network hops use one 400 Gb/s ConnectX-7 port each",
           "nvidia2023dgxh100guide"),
    System("2x DGX H100, 8 rails", 16, "ndr",
           "8 rings at once, each through a different one of a node's 8 ConnectX-7 ports, NVLink inside",
           "nvidia2023dgxh100guide", rails=8, intra="nvlink4"),
]}


def system(key: str) -> System:
    if key not in SYSTEMS:
        raise KeyError(f"unknown system {key!r}; known: {', '.join(SYSTEMS)}")
    return SYSTEMS[key]


def table_problems(links: dict[str, Link] = LINKS) -> list[str]:
    """Entries whose stored per-direction figure disagrees with the number quoted from the source."""
    problems = []
    for l in links.values():
        if l.kind not in KINDS:
            problems.append(f"{l.key}: kind {l.kind!r} not in {KINDS}")
        number = float(l.quoted.split()[0])
        if l.kind == "nvlink" and abs(2 * l.gbs_per_direction - number) > 1e-9:
            problems.append(f"{l.key}: {l.gbs_per_direction} GB/s each way is not half of {l.quoted}")
        if l.kind in ("infiniband", "ethernet") and abs(8 * l.gbs_per_direction - number) > 1e-9:
            problems.append(f"{l.key}: {l.gbs_per_direction} GB/s is not {l.quoted} / 8")
        if l.key in DATASHEET_TOTALS_GBS and abs(2 * l.gbs_per_direction - DATASHEET_TOTALS_GBS[l.key][0]) > 2:
            problems.append(f"{l.key}: 2 x {l.gbs_per_direction:.1f} GB/s is not the datasheet's "
                            f"{DATASHEET_TOTALS_GBS[l.key][0]} GB/s")
    return problems
