"""Hardware profiles: what a machine can compute and move, for planning runs it may not be.

A profile is a typed, JSON-able record. The published GPU profiles hold datasheet peaks (dense
tensor-core FLOP/s, HBM size and bandwidth) and the efficiency factors this simulator applies
to them, stated here and in docs/predictions.md. The ``cpu`` profile is measured on this
machine by ``tierflow calibrate`` (see ``calibrate.py``, whose ``hardware(name)`` returns
either): it has no GPU, so RAM is the compute tier and the disk the offload tier. No torch
here.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..core.errors import TierflowError

GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """One machine. Bandwidths are bytes/s, FLOP rates FLOP/s, sizes bytes.

    ``peak_flops`` maps a matmul dtype (``fp32``, ``bf16``, ``fp8``) to the dense peak; a dtype
    missing from it is not supported there. ``matmul_efficiency`` is the fraction of that
    peak training matmuls reach (the MFU of a compute-bound step); ``attention_efficiency``
    the fraction causal attention's kernels reach (None: the matmuls' fraction);
    ``memory_efficiency`` the fraction of ``memory_bw`` that element-wise kernels reach.
    ``host_memory_bw`` prices the host optimizer: bytes of its modelled traffic per second.
    Host link and disk figures are already the rates reached in practice, not the nominal
    ones.
    """

    name: str
    about: str  # where the numbers come from
    gpu_bytes: int | None  # device memory; None: no GPU, compute runs in RAM
    peak_flops: dict[str, float]
    memory_bw: float  # of the compute tier (HBM, or RAM on the cpu profile)
    host_link_bw: float | None  # GPU <-> RAM, each direction; None without a GPU
    host_memory_bw: float  # RAM bandwidth the host optimizer reaches (AdamW on the CPU)
    disk_read_bw: float
    disk_write_bw: float
    matmul_efficiency: float
    memory_efficiency: float
    ram_bytes: int | None = None  # installed RAM, for the defaults of --ram; None: unknown
    attention_efficiency: float | None = None  # of the matmul dtype's peak, causal
    # attention's forward + backward (flash kernels); None: as the matmuls
    host_runtime_bytes: int = 0  # host RAM a GPU's runtime holds (context, kernel libraries)
    notes: tuple[str, ...] = field(default_factory=tuple)
    # bytes of modelled traffic per second of the host optimizer by moment dtype, where it
    # was measured (the cpu profile); a dtype missing here updates at host_memory_bw
    optimizer_bw: dict[str, float] = field(default_factory=dict)

    def update_bw(self, moments: str) -> float:
        """Bytes/s of modelled traffic the host optimizer reaches with ``moments``."""
        return self.optimizer_bw.get(moments, self.host_memory_bw)

    @property
    def has_gpu(self) -> bool:
        return self.gpu_bytes is not None

    @property
    def compute_tier(self) -> str:
        """Where the matmuls run: ``gpu``, or ``ram`` on a machine without one."""
        return "gpu" if self.has_gpu else "ram"

    def flops(self, dtype: str) -> float:
        """The dense peak for matmuls in ``dtype``; a one-line error when it has none."""
        if dtype not in self.peak_flops:
            raise TierflowError(f"--matmul-dtype {dtype} is not supported by hardware "
                                f"{self.name} (it has {', '.join(sorted(self.peak_flops))}): "
                                f"use one of those")
        return self.peak_flops[dtype]

    def to_json(self) -> str:
        return json.dumps({"format": "tierflow-hardware", **asdict(self)}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Hardware:
        data = json.loads(text)
        if data.pop("format", None) != "tierflow-hardware":
            raise ValueError("not a tierflow hardware profile (format: tierflow-hardware)")
        data["notes"] = tuple(data.get("notes", ()))
        return cls(**data)


# Efficiency factors of the published profiles, applied to the datasheet peaks. Data-center
# parts: 0.6 of peak bf16 (ml_dataflow's H100 measures 59% MFU; Megatron-class training
# reports 50-60%); consumer Ada/Ampere cards with small models: 0.75 (llm.q reports 75% SOL
# on a 4090). fp8 reaches a lower fraction of its doubled peak: 0.45 (llm.q's H100 fp8 runs).
# Element-wise kernels reach 0.8 of HBM bandwidth.
DATACENTER_MATMUL = 0.6
CONSUMER_MATMUL = 0.75
MEMORY_EFFICIENCY = 0.8
PCIE4 = 25 * GB  # in practice (nominal 32)
PCIE5 = 50 * GB  # in practice (nominal 64)
NVME4_READ, NVME4_WRITE = 7 * GB, 5 * GB
# host RAM the CUDA runtime holds once a trainer has used it (context, cuBLAS, attention
# forward and backward): 403 MiB measured on an H200 with torch 2.11 and CUDA 13
# (benchmarks/results/gpu-check-2026-11-28-h200-llama8b-reserve.json, cuda_runtime_host_mib)
CUDA_HOST_RUNTIME = 403 << 20
FP8_EFFICIENCY_SCALE = 0.75  # fp8 matmuls reach a smaller fraction of their doubled peak


def _gpu(name: str, about: str, gib: float, bf16_tflops: float, fp8_tflops: float | None,
         hbm_tb_s: float, link: float, host_memory_gb_s: float, matmul_eff: float) -> Hardware:
    peaks = {"fp32": bf16_tflops * 1e12 / 2, "bf16": bf16_tflops * 1e12}  # fp32 via TF32
    if fp8_tflops:
        peaks["fp8"] = fp8_tflops * 1e12
    return Hardware(name=name, about=about, gpu_bytes=int(gib * 2 ** 30), peak_flops=peaks,
                    memory_bw=hbm_tb_s * 1e12, host_link_bw=link,
                    host_memory_bw=host_memory_gb_s * GB, disk_read_bw=NVME4_READ,
                    disk_write_bw=NVME4_WRITE, matmul_efficiency=matmul_eff,
                    memory_efficiency=MEMORY_EFFICIENCY, host_runtime_bytes=CUDA_HOST_RUNTIME,
                    notes=_notes(matmul_eff, link, host_memory_gb_s))


def _notes(matmul_eff: float, link: float, host_memory_gb_s: float) -> tuple[str, ...]:
    """The efficiency factors and practical rates of a published profile, in words."""
    fp8 = FP8_EFFICIENCY_SCALE * matmul_eff
    disk = f"{NVME4_READ / GB:.0f}/{NVME4_WRITE / GB:.0f}"
    return (f"matmul efficiency {matmul_eff:.2f} of the dense peak (fp8: {fp8:.2f})",
            f"elementwise kernels at {MEMORY_EFFICIENCY:.2f} of HBM bandwidth",
            f"host link {link / GB:.0f} GB/s, NVMe {disk} GB/s read/write, as reached in practice",
            f"host optimizer at {host_memory_gb_s:.0f} GB/s of DRAM traffic")

PUBLISHED: dict[str, Hardware] = {h.name: h for h in (
    _gpu("h100-sxm", "NVIDIA H100 SXM5 80GB datasheet: 989 bf16 / 1979 fp8 dense TFLOPS, "
         "3.35 TB/s, PCIe 5 host link", 80, 989, 1979, 3.35, PCIE5, 100, DATACENTER_MATMUL),
    _gpu("h100-pcie", "NVIDIA H100 PCIe 80GB datasheet: 756 bf16 / 1513 fp8 dense TFLOPS, "
         "2.0 TB/s, PCIe 5", 80, 756, 1513, 2.0, PCIE5, 100, DATACENTER_MATMUL),
    _gpu("h200", "NVIDIA H200 SXM 141GB datasheet: 989 bf16 / 1979 fp8 dense TFLOPS, "
         "4.8 TB/s, PCIe 5", 141, 989, 1979, 4.8, PCIE5, 100, DATACENTER_MATMUL),
    _gpu("a100-80gb", "NVIDIA A100 SXM 80GB datasheet: 312 bf16 dense TFLOPS (no fp8), "
         "2.04 TB/s, PCIe 4", 80, 312, None, 2.04, PCIE4, 80, DATACENTER_MATMUL),
    _gpu("l40s", "NVIDIA L40S datasheet: 362 bf16 / 733 fp8 dense TFLOPS, 48 GB at 864 GB/s, "
         "PCIe 4", 48, 362, 733, 0.864, PCIE4, 80, CONSUMER_MATMUL),
    _gpu("rtx4090", "NVIDIA Ada whitepaper, RTX 4090: 165 bf16 / 330 fp8 dense TFLOPS with "
         "fp32 accumulate, 24 GB at 1.01 TB/s, PCIe 4", 24, 165, 330, 1.008, PCIE4, 40,
         CONSUMER_MATMUL),
    _gpu("rtx3090", "NVIDIA Ampere GA102 whitepaper, RTX 3090: 71 bf16 dense TFLOPS with fp32 "
         "accumulate (no fp8), 24 GB at 936 GB/s, PCIe 4", 24, 71, None, 0.936, PCIE4, 40,
         CONSUMER_MATMUL),
)}

NAMES = ("cpu", *PUBLISHED)


def effective_flops(hw: Hardware, dtype: str) -> float:
    """FLOP/s that training matmuls in ``dtype`` reach on ``hw``: peak x efficiency."""
    scale = FP8_EFFICIENCY_SCALE if dtype == "fp8" else 1.0
    return hw.flops(dtype) * hw.matmul_efficiency * scale


def effective_attention_flops(hw: Hardware, dtype: str) -> float:
    """FLOP/s that causal attention (forward and backward) reaches on ``hw``."""
    if hw.attention_efficiency is None:
        return effective_flops(hw, dtype)
    return hw.flops(dtype) * hw.attention_efficiency

