"""Figures quoted from vendor documentation and papers (nothing here was measured by the course).

Bandwidths are bytes per second per GPU in one direction, as the vendor's total is split: NVLink's
"600 GB/s" (A100) and "900 GB/s" (H100) are both directions together; an InfiniBand port's
"200 Gb/s" (HDR) or "400 Gb/s" (NDR) is bits per second each way. DGX A100 and DGX H100 give each
of their 8 GPUs its own InfiniBand port for the compute fabric.
"""
from __future__ import annotations

import dataclasses

from labkit import tensor_parallel as tpk

GB = 10 ** 9


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A cluster shape: nodes of `gpus_per_node` GPUs, a fast link inside a node and a slower one
    between nodes."""
    name: str
    nodes: int
    gpus_per_node: int
    peak_flops: float          # per GPU, dense BF16 (vendor datasheet)
    memory: float              # bytes per GPU
    intra_bw: float            # bytes/s per GPU, one direction, inside a node
    inter_bw: float            # bytes/s per GPU, one direction, between nodes
    source: str = ""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def with_nodes(self, nodes: int) -> "Cluster":
        return dataclasses.replace(self, nodes=nodes)


A100_PEAK_BF16 = 312e12   # NVIDIA A100 datasheet: BF16 Tensor Core 312 TFLOPS (624 with sparsity)
H100_PEAK_BF16 = 989e12   # NVIDIA H100 SXM datasheet: BF16 Tensor Core 1,979 TFLOPS with sparsity
HDR_PORT = 200e9 / 8      # InfiniBand HDR, 200 Gb/s per port (ConnectX-6; DGX A100 datasheet)

DGX_A100 = Cluster(
    "DGX A100 nodes (8 x A100 80GB, NVLink 3, 8 x HDR InfiniBand)", nodes=1, gpus_per_node=8,
    peak_flops=A100_PEAK_BF16, memory=80 * GB,
    intra_bw=tpk.INTERCONNECTS["NVLink 3 (A100 SXM, 12 links)"][0], inter_bw=HDR_PORT,
    source="NVIDIA A100 Tensor Core GPU datasheet (312 TFLOPS BF16 dense, NVLink 600 GB/s total); "
           "NVIDIA DGX A100 datasheet (8 x single-port ConnectX-6 200 Gb/s HDR InfiniBand)")
DGX_H100 = Cluster(
    "DGX H100 nodes (8 x H100 80GB, NVLink 4, 8 x NDR InfiniBand)", nodes=1, gpus_per_node=8,
    peak_flops=H100_PEAK_BF16, memory=80 * GB,
    intra_bw=tpk.INTERCONNECTS["NVLink 4 (H100 SXM, 18 links)"][0],
    inter_bw=tpk.INTERCONNECTS["InfiniBand NDR (one 400 Gb/s port)"][0],
    source="NVIDIA H100 Tensor Core GPU datasheet (1,979 TFLOPS BF16 with sparsity, NVLink 900 "
           "GB/s total); NVIDIA DGX H100 datasheet (8 x ConnectX-7 400 Gb/s NDR)")
CLUSTERS = {"DGX A100": DGX_A100, "DGX H100": DGX_H100}


@dataclasses.dataclass(frozen=True)
class Model:
    """A GPT-like model: `layers` transformer layers of width `hidden`, `heads` attention heads,
    sequences of `seq` tokens, a vocabulary of `vocab` (embedding tied with the output layer)."""
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200

    @property
    def parameters(self) -> int:
        from labkit.memory.ledger import transformer_parameters
        return transformer_parameters(self.layers, self.hidden, self.vocab)


# Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM", Table 1 (weak scaling on Selene, DGX A100 nodes; vocabulary 51,200, sequence 2048).
# (billions of parameters, heads, hidden, layers, t, p, GPUs, batch size, achieved TFLOP/s per GPU)
MEGATRON_2021 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
MEGATRON_SOURCE = ("Narayanan et al. 2021 (SC21, arXiv 2104.04473), Table 1: t, p and d = GPUs / "
                   "(t p) chosen per model size; micro-batch size and schedule as in the paper's "
                   "section 5.1")


def megatron_rows() -> list:
    """The table as dicts: model, t, p, d, gpus, batch, tflops (what the paper achieved)."""
    rows = []
    for billions, heads, hidden, layers, t, p, gpus, batch, tflops in MEGATRON_2021:
        model = Model(f"{billions:g}B", layers, hidden, heads)
        rows.append({"model": model, "billions": billions, "t": t, "p": p, "d": gpus // (t * p),
                     "gpus": gpus, "batch": batch, "tflops": tflops})
    return rows
