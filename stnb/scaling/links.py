"""Link models for the scaling predictor: the collectives' costs (latency + size / bus bandwidth), and the
presets, each with its source.

A link has a **bus bandwidth** (what nccl-tests' doc/PERFORMANCE.md calls busbw: the bytes per second each
rank's link carries one way during a ring collective), given as a range (low, mid, high) from the
topology's link count and the collective library's protocol efficiency, never a bare datasheet peak;
``latency`` alpha, the cost of one ring step; and ``launch``, a fixed cost per collective (low, mid,
high: a kernel launch and the library's enqueue up to a wrapper's per-collective host work). The ring
costs (nccl-tests doc/PERFORMANCE.md: an all-reduce of S bytes over n ranks moves 2(n-1)/n x S through
each rank's link, a reduce-scatter or all-gather (n-1)/n x S, a broadcast or reduce S):

    all_reduce(S, n)      = launch + 2(n-1) alpha + 2(n-1)/n  S / B
    reduce_scatter(S, n)  = launch +  (n-1) alpha +  (n-1)/n  S / B      (all_gather the same)
    broadcast(S), reduce(S) = launch + alpha + S / B

so small messages pay the latency terms and large ones the bandwidth (message-size dependence).
A ``Fabric`` holds the link, the network and which end of each range a prediction uses (``point``:
'low', 'mid' or 'high' for the bandwidth and the per-collective cost); ``stnb.scaling.interval`` walks
the ends. ``overlap`` says whether communication can run beside compute: on GPUs NCCL runs on its own
stream; on CPU (gloo over loopback) the reduction needs the cores that compute.

Beyond ``per_node`` devices a job spans nodes: the collective is hierarchical (inside each node on
the link, between nodes on the ``network`` preset, one network card per node).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from ..errors import ConfigError

GB = 1e9
US = 1e-6
ENDS = ("low", "mid", "high")


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float        # bus bandwidth, bytes/s one rank's link carries one way (the mid of the range)
    latency: float          # seconds per ring step
    overlap: bool           # communication runs beside compute (GPU streams) or takes its cores (CPU)
    per_node: int | None    # devices one node holds on this link (None: a network, any number)
    source: str             # where the numbers come from
    bandwidth_range: tuple | None = None  # (low, high) bus bandwidth; None: exactly ``bandwidth``
    launch: tuple = (0.0, 0.0, 0.0)       # fixed seconds per collective (low, mid, high)
    tiers: tuple = ()       # ((at most n devices, low, mid, high), ...): the bus bandwidth of a smaller group
    # ((n, low, mid, high), ...): a rank's compute slowdown when n ranks share one machine's CPU cores, against the
    # run the prediction starts from (``calibrate.sharing``); () or an n not listed: every device its own (1.0)
    sharing: tuple = ()
    sharing_source: str = ""

    def bus_bandwidth(self, n: int, end: str = "mid") -> float:
        """The bus bandwidth (bytes/s) of a collective over n devices on this link, at one end of its range."""
        for most, *lmh in sorted(self.tiers):
            if n <= most:
                return lmh[ENDS.index(end)]
        lo, hi = self.bandwidth_range or (self.bandwidth, self.bandwidth)
        return {"low": lo, "mid": self.bandwidth, "high": hi}[end]

    def compute_factor(self, n: int, end: str = "mid") -> float:
        """How much slower each of n ranks computes than the measured run did (1.0: a device of its own)."""
        for most, *lmh in self.sharing:
            if n == most:
                return lmh[ENDS.index(end)]
        return 1.0

    def describe(self) -> str:
        lo, hi = self.bandwidth_range or (self.bandwidth, self.bandwidth)
        bw = (f"{self.bandwidth / GB:.3g} GB/s" if lo == hi else
              f"{lo / GB:.3g} / {self.bandwidth / GB:.3g} / {hi / GB:.3g} GB/s (low / mid / high)")
        tiers = "".join(f"; up to {t[0]} devices {t[1] / GB:.3g} / {t[2] / GB:.3g} / {t[3] / GB:.3g} GB/s"
                        for t in sorted(self.tiers))
        launch = ("" if not any(self.launch) else
                  f", per collective {' / '.join(f'{x / US:.3g}' for x in self.launch)} us")
        return (f"{self.name}: bus bandwidth {bw} per direction{tiers}, latency {self.latency / US:.3g} us per ring "
                f"step{launch}, {'overlaps compute' if self.overlap else 'does not overlap compute'} ({self.source})")

    def to_dict(self) -> dict:
        return asdict(self)


def effective(name, links, per_link_gbs, efficiency, per_node, source, latency_us=5.0, launch_us=(5, 15, 50),
              overlap=True, tiers=()) -> Link:
    """A preset from its topology: ``links`` (low, high) links a rank drives, ``per_link_gbs`` each one's
    peak per direction, ``efficiency`` (low, mid, high) the protocol's share of it. low = fewest links at
    the lowest efficiency, mid = most links at the mid efficiency, high = most links at the highest."""
    lo, hi = links
    bw = (lo * per_link_gbs * efficiency[0] * GB, hi * per_link_gbs * efficiency[1] * GB,
          hi * per_link_gbs * efficiency[2] * GB)
    return Link(name, bw[1], latency_us * US, overlap, per_node,
                f"{source}; {lo if lo == hi else f'{lo}-{hi}'} link(s) x {per_link_gbs:g} GB/s, protocol efficiency "
                f"{efficiency[0]:g}-{efficiency[2]:g} (mid {efficiency[1]:g}); latency and per-collective cost: "
                "orders of magnitude, not measured",
                (bw[0], bw[2]), tuple(x * US for x in launch_us), tuple(tiers))


NCCL = "NCCL's ring protocol efficiency on large messages about 0.8 of the links' peak (nccl-tests busbw)"
# A p3.8xlarge's 4 V100s are one quad of the DGX-1's hybrid cube mesh (NVIDIA DGX-1 with Tesla V100 System
# Architecture white paper): per GPU 6 NVLink 2.0 links of 25 GB/s per direction, 4 or 5 of them to the other
# three GPUs of its quad (nvidia-smi topo -m: NV1/NV2 pairs), the rest to the other quad. A ring over the
# quad is held back by the GPU with the fewest links to the other three (4), and NCCL may find rings over 3.
_QUAD = dict(links=(3, 4), per_link_gbs=25, efficiency=(0.7, 0.8, 0.9))
_CUBE = dict(links=(4, 6), per_link_gbs=25, efficiency=(0.7, 0.8, 0.9))


def _quad_tier():
    q = effective("q", per_node=4, source="", **_QUAD)
    return (4, q.bandwidth_range[0], q.bandwidth, q.bandwidth_range[1])


PRESETS = {p.name: p for p in (
    effective("pcie3", (1, 1), 15.75, (0.6, 0.75, 0.85), 8,
              "PCIe 3.0 x16: 15.75 GB/s per direction (8 GT/s x 16 lanes, 128b/130b, PCI-SIG); " + NCCL +
              ", less through a PCIe switch or the CPU's root complex", latency_us=10),
    effective("pcie4", (1, 1), 31.5, (0.6, 0.75, 0.85), 8,
              "PCIe 4.0 x16: 31.5 GB/s per direction (16 GT/s x 16 lanes, PCI-SIG); " + NCCL, latency_us=10),
    effective("pcie5", (1, 1), 63.0, (0.6, 0.75, 0.85), 8,
              "PCIe 5.0 x16: 63 GB/s per direction (32 GT/s x 16 lanes, PCI-SIG); " + NCCL, latency_us=10),
    effective("nvlink-v100", per_node=8, tiers=(_quad_tier(),),
              source="DGX-1 / p3.16xlarge, 8 V100s in the hybrid cube mesh (NVIDIA DGX-1 with Tesla V100 System "
                     "Architecture white paper): 6 NVLink 2.0 links per GPU, NCCL's rings over 4 to 6 of them; up "
                     "to 4 devices one quad (see nvlink-v100-4); " + NCCL, **_CUBE),
    effective("nvlink-v100-4", per_node=4,
              source="p3.8xlarge, 4 V100s: one quad of the DGX-1's hybrid cube mesh, 4 or 5 NVLink 2.0 links per "
                     "GPU to the other three (the ring runs at the GPU with the fewest), NCCL's rings over 3 to 4; "
                     + NCCL, **_QUAD),
    effective("nvlink-a100", (12, 12), 25, (0.7, 0.8, 0.9), 8,
              "DGX A100: 12 NVLink 3.0 links of 25 GB/s per direction per GPU through NVSwitch (NVIDIA A100 "
              "datasheet: 600 GB/s both ways); " + NCCL),
    effective("nvlink-h100", (18, 18), 25, (0.7, 0.8, 0.9), 8,
              "DGX H100: 18 NVLink 4.0 links of 25 GB/s per direction per GPU through NVSwitch (NVIDIA H100 SXM "
              "datasheet: 900 GB/s both ways); " + NCCL),
    effective("25gbps", (1, 1), 25 / 8, (0.6, 0.8, 0.9), None,
              "25 Gb/s Ethernet: 3.125 GB/s line rate, TCP/IP (NCCL's socket transport) below it",
              latency_us=30, launch_us=(10, 30, 100)),
    effective("100gbps", (1, 1), 100 / 8, (0.8, 0.9, 0.95), None,
              "100 Gb/s InfiniBand/RoCE: 12.5 GB/s line rate, RDMA (NCCL's IB transport) near it",
              launch_us=(5, 15, 50)),
    effective("400gbps", (1, 1), 400 / 8, (0.8, 0.9, 0.95), None,
              "400 Gb/s InfiniBand/RoCE: 50 GB/s line rate, RDMA (NCCL's IB transport) near it",
              launch_us=(5, 15, 50)),
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
           source: str = "given by the user", bandwidth_range_gbs: tuple | None = None,
           launch_us: tuple = (0.0, 0.0, 0.0)) -> Link:
    """A link of your own: bus bandwidth in GB/s per direction (optionally its (low, high) range), latency
    per ring step and the fixed cost per collective (low, mid, high) in microseconds."""
    rng = None if bandwidth_range_gbs is None else tuple(x * GB for x in bandwidth_range_gbs)
    return Link(name, bandwidth_gbs * GB, latency_us * US, overlap, per_node, source, rng,
                tuple(x * US for x in launch_us))


@dataclass(frozen=True)
class Fabric:
    """The link inside a node and the network between nodes; costs of collectives over n devices at one
    end of each range (``point``: {'bandwidth': 'low'|'mid'|'high', 'launch': ...})."""
    link: Link
    network: Link
    point: dict = field(default_factory=lambda: {"bandwidth": "mid", "launch": "mid", "sharing": "mid"})

    def at(self, **ends) -> "Fabric":
        return replace(self, point={**self.point, **ends})

    def _levels(self, n: int):
        g = self.link.per_node
        if g is None or n <= g:
            return [(self.link, n)]
        return [(self.link, g), (self.network, math.ceil(n / g))]

    def _ring(self, level, nbytes: float, passes: int) -> float:
        link, n = level
        if n <= 1:
            return 0.0
        bw = link.bus_bandwidth(n, self.point["bandwidth"])
        return passes * ((n - 1) * link.latency + (n - 1) / n * nbytes / bw)

    def _launch(self, link: Link) -> float:
        return link.launch[ENDS.index(self.point["launch"])]

    def all_reduce(self, nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        levels = self._levels(n)
        if len(levels) == 1:
            return self._launch(self.link) + self._ring(levels[0], nbytes, 2)
        (inner, g), (outer, m) = levels
        # reduce-scatter inside the node, all-reduce the node's whole sum over its one card, all-gather
        return (2 * self._launch(inner) + 2 * self._ring((inner, g), nbytes, 1) + self._launch(outer)
                + self._ring((outer, m), nbytes, 2))

    def all_gather(self, nbytes: float, n: int) -> float:
        """Every rank ends with all nbytes (each held nbytes / n); reduce_scatter costs the same."""
        if n <= 1:
            return 0.0
        return sum(self._launch(level[0]) + self._ring(level, nbytes, 1) for level in self._levels(n))

    reduce_scatter = all_gather

    def broadcast(self, nbytes: float, n: int) -> float:
        """One rank's nbytes to all (DataParallel's replicate; its reduce to GPU 0 costs the same)."""
        if n <= 1:
            return 0.0
        return self._launch(self.link) + self.link.latency + nbytes / self.link.bus_bandwidth(n, self.point["bandwidth"])

    def compute_factor(self, n: int) -> float:
        """A rank's compute slowdown among n ranks on this link's machine (the shared CPU cores), at the point's end."""
        return self.link.compute_factor(n, self.point["sharing"])

    @property
    def overlap(self) -> bool:
        return self.link.overlap


def fabric(link, network="100gbps") -> Fabric:
    inner = resolve(link)
    return Fabric(inner, resolve(network) if not isinstance(network, Link) else network)

