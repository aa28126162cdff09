"""Hardware profiles: what a GPU and its cluster can do, as data, each number with its source.

A performance model of a training run at scale needs, per GPU, the peak of the tensor
cores in each format and the memory's capacity and bandwidth, and per cluster the links:
GPUs per node, the bandwidth and latency inside a node (NVLink through NVSwitch) and across
nodes (one network port per GPU). The profiles are JSON files next to this module
(hardware/profiles/NAME.json), so a reader can check every number against the source it
names, and a new machine is a new file:

    name             a100-40g, a100-80g, h100-sxm, h200
    peak_flops       {format: dense FLOP/s} for fp64, fp32, tf32, bf16, fp16 (fp8 on Hopper)
    hbm_bytes        memory per GPU; hbm_bytes_per_s its bandwidth
    gpus_per_node    8 (DGX / HGX)
    intra, inter     {bytes_per_s: one GPU's port, one direction; latency_s: per message}
    sources          where each group of numbers comes from (the latencies are assumptions,
                     said so: data sheets do not give them)
`this_machine()` describes the machine minidist runs on in the same terms: one node of
`cores` ranks, the peak one rank's NumPy matmul reaches (observe/peak.py, measured and
cached), its read bandwidth (hardware/cpu_caches.py) and the shared-memory link of
collectives/calibration.py's constants (this machine's fit, or the defaults).

`Hardware.topology()` gives the two-level topology collectives/tiers.py prices collectives
on, and `layout_span(plan, hardware)` where each mesh axis's group of a Plan lies on it
(Plan.group_ranks: the ranks `build` gives each group). Nothing here communicates.
References: NVIDIA A100, H100 and H200 Tensor Core GPU datasheets; NVIDIA DGX A100 and DGX
    H100 user guides (one compute-fabric InfiniBand port per GPU).
Read next: collectives/tiers.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from minidist.collectives import calibration
from minidist.collectives.tiers import Link, Topology
from minidist.hardware import cpu_caches
from minidist.observe import peak

FOLDER = Path(__file__).resolve().parent / "profiles"
FORMATS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8")


@dataclass(frozen=True)
class Hardware:
    """One GPU kind and its cluster (module docstring); bytes per second and seconds."""

    name: str
    description: str
    peak_flops: dict[str, float]
    hbm_bytes: int
    hbm_bytes_per_s: float
    gpus_per_node: int
    intra_bytes_per_s: float
    intra_latency_s: float
    inter_bytes_per_s: float
    inter_latency_s: float
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.peak_flops) - set(FORMATS)
        if unknown or not self.peak_flops or any(v <= 0 for v in self.peak_flops.values()):
            raise ValueError(f"Hardware {self.name!r}: peak_flops needs positive rates for "
                             f"formats among {FORMATS}; got {self.peak_flops}.")
        for what in ("hbm_bytes", "hbm_bytes_per_s", "gpus_per_node", "intra_bytes_per_s",
                     "inter_bytes_per_s"):
            if not getattr(self, what) > 0:
                raise ValueError(f"Hardware {self.name!r}: {what}={getattr(self, what)!r} "
                                 "must be > 0.")
        if self.intra_latency_s < 0 or self.inter_latency_s < 0:
            raise ValueError(f"Hardware {self.name!r}: latencies must be >= 0.")

    def peak(self, fmt: str) -> float:
        """Dense FLOP/s of the tensor cores (or vector units) in `fmt`."""
        if fmt not in self.peak_flops:
            raise ValueError(f"Hardware {self.name!r} has no {fmt!r} rate; it has "
                             f"{', '.join(self.peak_flops)}.")
        return self.peak_flops[fmt]

    def topology(self) -> Topology:
        """Nodes of gpus_per_node ranks: NVLink inside, the network across (tiers.py)."""
        return Topology(self.gpus_per_node,
                        Link(self.intra_latency_s, 1.0 / self.intra_bytes_per_s),
                        Link(self.inter_latency_s, 1.0 / self.inter_bytes_per_s))


def layout_span(plan, hardware: Hardware) -> dict[str, tuple[int, int]]:
    """Where rank 0's group on each mesh axis of `plan` (parallel/compose.Plan) lies on
    `hardware`'s nodes: {axis: (nodes it touches, its ranks on one node)}. With Megatron's
    order (tp the fastest axis) tp stays inside a node while it fits, dp and pp cross."""
    topo = hardware.topology()
    return {axis: topo.span(ranks) for axis, ranks in plan.group_ranks(0).items()}


def names() -> list[str]:
    """The profiles shipped in hardware/profiles/, sorted."""
    return sorted(p.stem for p in FOLDER.glob("*.json"))


def load(name: str) -> Hardware:
    """The profile called `name` (a file of hardware/profiles/); ValueError naming the
    choices for another name, and the file and field for a malformed one."""
    path = FOLDER / f"{name}.json"
    if name not in names():
        raise ValueError(f"hardware {name!r} is unknown; profiles: {', '.join(names())}, "
                         "or 'cpu' for this machine.")
    raw = json.loads(path.read_text())
    try:
        return Hardware(name=raw["name"], description=raw["description"],
                        peak_flops={k: float(v) for k, v in raw["peak_flops"].items()},
                        hbm_bytes=int(raw["hbm_bytes"]),
                        hbm_bytes_per_s=float(raw["hbm_bytes_per_s"]),
                        gpus_per_node=int(raw["gpus_per_node"]),
                        intra_bytes_per_s=float(raw["intra"]["bytes_per_s"]),
                        intra_latency_s=float(raw["intra"]["latency_s"]),
                        inter_bytes_per_s=float(raw["inter"]["bytes_per_s"]),
                        inter_latency_s=float(raw["inter"]["latency_s"]),
                        sources=dict(raw.get("sources", {})))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: field {e} is missing or malformed") from None


def this_machine(measure: bool = True, memory_bytes: int | None = None) -> Hardware:
    """This machine as one node of `os.cpu_count()` ranks: one rank's matmul peak (float32
    and float64; measured once and cached by observe/peak.py), the read bandwidth of a
    256 MiB working set (hardware/cpu_caches.py), its memory (memory_bytes, else the
    physical memory) and the shared-memory link of the collectives' constants (alpha, beta
    per byte). measure=False puts 1 GFLOP/s and 1 GB/s in place of the two measurements."""
    c = calibration.constants(None)
    flops = {fmt: (peak.peak_flops(dtype).flops if measure else 1e9)
             for fmt, dtype in (("fp32", "float32"), ("fp64", "float64"))}
    read = cpu_caches.measure(256 * cpu_caches.MB).read_gbs * 1e9 if measure else 1e9
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cores = os.cpu_count() or 1
    return Hardware(name="cpu", description=f"this machine: {peak.cpu_model()}, {cores} "
                    "cores as one node, shared-memory collectives",
                    peak_flops=flops, hbm_bytes=int(memory_bytes),
                    hbm_bytes_per_s=read, gpus_per_node=cores,
                    intra_bytes_per_s=1.0 / max(c.beta, 1e-15), intra_latency_s=c.alpha,
                    inter_bytes_per_s=1.0 / max(c.beta, 1e-15), inter_latency_s=c.alpha,
                    sources={"compute": "observe/peak.py: one rank's NumPy matmul, measured",
                             "memory": "hardware/cpu_caches.py: sequential read, 256 MiB",
                             "links": "collectives/calibration.py: alpha and beta fitted on "
                                      "this machine (or the defaults)"})
