"""Interconnects (seed §2.3, 토폴로지와 하드웨어): bandwidth per direction from each link's spec."""
from __future__ import annotations

import pandas as pd


def pcie_bytes_per_s(gigatransfers: float, lanes: int = 16) -> float:
    """PCIe payload rate per direction: lanes x GT/s x 128/130 (encoding) / 8 bits."""
    return lanes * gigatransfers * 1e9 * 128 / 130 / 8


def nvlink_bytes_per_s(links: int, per_link_per_direction: float = 25e9) -> float:
    return links * per_link_per_direction


def gbit(gigabits: float) -> float:
    return gigabits * 1e9 / 8


# (link, scope, bytes/s per direction, latency order of magnitude in seconds)
LINKS = [
    ("PCIe 4.0 x16", "host <-> GPU, GPU <-> NIC", pcie_bytes_per_s(16), 1e-6),
    ("PCIe 5.0 x16", "host <-> GPU, GPU <-> NIC", pcie_bytes_per_s(32), 1e-6),
    ("NVLink 3 (A100, 12 links)", "GPU <-> GPU in a node", nvlink_bytes_per_s(12), 1e-6),
    ("NVLink 4 (H100, 18 links)", "GPU <-> GPU in a node", nvlink_bytes_per_s(18), 1e-6),
    ("NVSwitch (DGX H100)", "any GPU <-> any GPU in a node", nvlink_bytes_per_s(18), 1e-6),
    ("InfiniBand HDR (4x)", "node <-> node", gbit(200), 2e-6),
    ("InfiniBand NDR (4x)", "node <-> node", gbit(400), 2e-6),
    ("Ethernet 100 GbE (TCP)", "node <-> node", gbit(100), 30e-6),
    ("Ethernet 400 GbE (TCP)", "node <-> node", gbit(400), 30e-6),
]


def link_table() -> pd.DataFrame:
    """One row per link: GB/s per direction and the latency's order of magnitude in us."""
    return pd.DataFrame([{"link": name, "scope": scope, "GB/s per direction": bw / 1e9,
                          "latency (us, order of magnitude)": lat * 1e6}
                         for name, scope, bw, lat in LINKS]).set_index("link")
