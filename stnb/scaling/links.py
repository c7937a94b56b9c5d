"""Link models for the scaling predictor: alpha-beta costs of the collectives, and the presets.

A link is two numbers (the alpha-beta model): ``latency`` alpha, the fixed cost of one step of a
ring (seconds), and ``bandwidth`` beta^-1, the bytes per second one rank can send one way. The
collective costs are the ring's, as NCCL's own benchmarks define them (nccl-tests,
doc/PERFORMANCE.md: an all-reduce of S bytes over n ranks moves 2(n-1)/n x S through each rank's
link, a reduce-scatter or all-gather (n-1)/n x S, a broadcast or reduce S):

    all_reduce(S, n)      = 2(n-1) alpha + 2(n-1)/n  S / B
    reduce_scatter(S, n)  =  (n-1) alpha +  (n-1)/n  S / B      (all_gather the same)
    broadcast(S), reduce(S) = alpha + S / B

Bandwidths are the vendors' peak per direction (sources below), never fitted to a result: a
prediction with them is an upper bound for communication-bound runs. Latencies are orders of
magnitude (stated as such). ``overlap`` says whether communication can run beside compute: on GPUs
NCCL runs on its own stream; on CPU (gloo over loopback) the reduction needs the cores that compute.

Beyond ``per_node`` devices a job spans nodes: the collective is hierarchical (inside each node on
the link, between nodes on the ``network`` preset, one network card per node).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ..errors import ConfigError

GB = 1e9


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float        # bytes/s one rank sends one way (peak)
    latency: float          # seconds per ring step
    overlap: bool           # communication runs beside compute (GPU streams) or takes its cores (CPU)
    per_node: int | None    # devices one node holds on this link (None: a network, any number)
    source: str             # where the bandwidth comes from

    def describe(self) -> str:
        return (f"{self.name}: {self.bandwidth / GB:.3g} GB/s per direction, latency {self.latency * 1e6:.3g} us, "
                f"{'overlaps compute' if self.overlap else 'does not overlap compute'} ({self.source})")

    def to_dict(self) -> dict:
        return asdict(self)


_LAT_NOTE = "latency: order of magnitude, not measured"
PRESETS = {p.name: p for p in (
    Link("pcie3", 15.75 * GB, 10e-6, True, 8, "PCIe 3.0 x16: 8 GT/s x 16 lanes, 128b/130b (PCI-SIG); " + _LAT_NOTE),
    Link("pcie4", 31.5 * GB, 10e-6, True, 8, "PCIe 4.0 x16: 16 GT/s x 16 lanes (PCI-SIG); " + _LAT_NOTE),
    Link("pcie5", 63.0 * GB, 10e-6, True, 8, "PCIe 5.0 x16: 32 GT/s x 16 lanes (PCI-SIG); " + _LAT_NOTE),
    Link("nvlink-v100", 150 * GB, 5e-6, True, 8,
         "NVIDIA V100 datasheet: NVLink 300 GB/s (6 links x 25 GB/s each way); " + _LAT_NOTE),
    Link("nvlink-a100", 300 * GB, 5e-6, True, 8, "NVIDIA A100 datasheet: NVLink 600 GB/s (both ways); " + _LAT_NOTE),
    Link("nvlink-h100", 450 * GB, 5e-6, True, 8,
         "NVIDIA H100 SXM datasheet: NVLink 900 GB/s (both ways); " + _LAT_NOTE),
    Link("25gbps", 25e9 / 8, 30e-6, True, None, "25 Gb/s Ethernet line rate (TCP); " + _LAT_NOTE),
    Link("100gbps", 100e9 / 8, 5e-6, True, None, "100 Gb/s InfiniBand/RoCE line rate (RDMA); " + _LAT_NOTE),
    Link("400gbps", 400e9 / 8, 5e-6, True, None, "400 Gb/s InfiniBand/RoCE line rate (RDMA); " + _LAT_NOTE),
)}
LOOPBACK = "loopback"
KNOWN = (LOOPBACK, *PRESETS)


def resolve(link) -> Link:
    """A Link from a preset name (``'loopback'`` is measured here, once per process) or a Link."""
    if isinstance(link, Link):
        return link
    if link == LOOPBACK:
        from .calibrate import loopback

        latency, bandwidth, how = loopback()
        return Link(LOOPBACK, bandwidth, latency, overlap=False, per_node=None, source=how)
    if link not in PRESETS:
        raise ConfigError(f"unknown link {link!r}; choose one of {', '.join(map(repr, KNOWN))} "
                          "(or pass a stnb.scaling.Link)")
    return PRESETS[link]


def custom(name: str, bandwidth_gbs: float, latency_us: float, overlap: bool = True, per_node: int | None = 8,
           source: str = "given by the user") -> Link:
    """A link of your own: bandwidth in GB/s per direction, latency in microseconds."""
    return Link(name, bandwidth_gbs * GB, latency_us * 1e-6, overlap, per_node, source)


@dataclass(frozen=True)
class Fabric:
    """The link inside a node and the network between nodes; costs of collectives over n devices."""
    link: Link
    network: Link

    def _levels(self, n: int):
        g = self.link.per_node
        if g is None or n <= g:
            return [(self.link, n)]
        return [(self.link, g), (self.network, math.ceil(n / g))]

    def all_reduce(self, nbytes: float, n: int) -> float:
        levels = self._levels(n)
        if len(levels) == 1:
            return _ring(levels[0], nbytes, 2)
        (inner, g), (outer, m) = levels
        # reduce-scatter inside the node, all-reduce the node's whole sum over its one card, all-gather
        return 2 * _ring((inner, g), nbytes, 1) + _ring((outer, m), nbytes, 2)

    def all_gather(self, nbytes: float, n: int) -> float:
        """Every rank ends with all nbytes (each held nbytes / n); reduce_scatter costs the same."""
        return sum(_ring(level, nbytes, 1) for level in self._levels(n))

    reduce_scatter = all_gather

    def broadcast(self, nbytes: float, n: int) -> float:
        """One rank's nbytes to all (DataParallel's replicate; its reduce to GPU 0 costs the same)."""
        return 0.0 if n <= 1 else self.link.latency + nbytes / self.link.bandwidth

    @property
    def overlap(self) -> bool:
        return self.link.overlap


def _ring(level, nbytes: float, passes: int) -> float:
    link, n = level
    if n <= 1:
        return 0.0
    return passes * ((n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth)


def fabric(link, network="100gbps") -> Fabric:
    inner = resolve(link)
    return Fabric(inner, resolve(network) if not isinstance(network, Link) else network)


def with_overlap(link: Link, overlap: bool) -> Link:
    return replace(link, overlap=overlap)
