"""Model FLOPs utilisation (MFU) of the training step: the FLOPs it performs, counted, per
second, divided by the most the machine can do.

The FLOPs are counted by :func:`transformer_tutorial.flops.count_flops` (``FlopCounterMode``)
on one forward, loss and backward of each model: matrix products and attention, at their
shapes. The optimizer step is not counted (Adam's updates are elementwise, a few operations a
parameter against about 6 a parameter a token for the products), but its time is in the step's
time, as in any MFU. Two peaks divide the achieved FLOP/s:

- **measured**, in the same run and with the same thread count: the best of ``--repeats``
  square matrix products (float32 on a CPU; on a GPU in the step's precision, bf16 by default);
- **data sheet**, on a GPU named in :data:`DATASHEET_PEAKS` (or given by ``--peak-tflops``).

The usual MFU (PaLM's) divides by the theoretical peak, as the data-sheet column does; the
measured peak is what the machine reaches, lower than its theoretical one, so utilisation of it
reads higher. And ``FlopCounterMode`` counts the products a step runs, padded positions
included where the model computes them: hardware FLOPs of the step, not the model's FLOPs of
its real tokens.
"""

from __future__ import annotations

import torch

from bench.cli import Settings, device_name
from bench.timing import timed_call

COUNTED = (
    "FlopCounterMode on forward + loss + backward (matrix products and attention); "
    "the optimizer step is timed but not counted"
)

# Dense peaks, FLOP/s, from NVIDIA's data sheets, by a part of the name
# torch.cuda.get_device_name() returns (the first that matches: the variants come first).
# The sheets give the tensor-core figures (BF16) "with sparsity" (2:4 structured): the dense
# peak is half of that. FP32 is the sheets' FP32 figure (CUDA cores; PyTorch does not use TF32
# for float32 matrix products by default). Sources:
#   H100 SXM, PCIe, NVL: "NVIDIA H100 Tensor Core GPU" data sheet,
#     nvidia.com/en-us/data-center/h100
#     (BF16 1,979 / 1,513 / 1,671 TFLOPS with sparsity; FP32 67 / 51 / 60 TFLOPS);
#   H200 SXM, NVL: "NVIDIA H200 Tensor Core GPU" data sheet, nvidia.com/en-us/data-center/h200
#     (BF16 1,979 / 1,671 TFLOPS with sparsity; FP32 67 / 60 TFLOPS);
#   A100 SXM and PCIe, 40 and 80 GB: "NVIDIA A100 Tensor Core GPU" data sheet,
#     nvidia.com/en-us/data-center/a100 (BF16 624 TFLOPS with sparsity, 312 dense; FP32 19.5).
DATASHEET_PEAKS = {
    "H100 PCIe": {"bf16": 756e12, "fp32": 51e12},
    "H100 NVL": {"bf16": 835e12, "fp32": 60e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "H200 NVL": {"bf16": 835e12, "fp32": 60e12},
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
}


def datasheet_peak(name: str, precision: str) -> float | None:
    """The dense peak FLOP/s of the GPU called ``name`` in ``precision``, or None if unknown."""
    for key, peaks in DATASHEET_PEAKS.items():
        if key.lower() in name.lower():
            return peaks.get(precision)
    return None


def matmul_peak(size: int, dtype: torch.dtype, repeats: int, device: torch.device) -> dict:
    """The best FLOP/s of ``repeats`` products of two ``(size, size)`` matrices, after one
    untimed product."""
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    out = torch.empty(size, size, device=device, dtype=dtype)
    seconds = [timed_call(lambda: torch.mm(a, b, out=out), device) for _ in range(repeats + 1)]
    best = min(seconds[1:])
    return {
        "size": size,
        "dtype": str(dtype).removeprefix("torch."),
        "repeats": repeats,
        "best_s": best,
        "flop_per_s": 2 * size**3 / best,
    }


def measure_peaks(s: Settings, device: torch.device) -> dict:
    """The section's peaks: ``{"counted", "matmul", "datasheet"}`` (datasheet None if unknown)."""
    matmul = matmul_peak(s.matmul_size, s.dtype, s.repeats, device)
    sheet = s.peak_flops
    if sheet is None and device.type == "cuda":
        sheet = datasheet_peak(device_name(device), s.precision)
    print(
        f"  matrix-multiply peak: {matmul['dtype']} {s.matmul_size}², best of {s.repeats}: "
        f"{matmul['flop_per_s'] / 1e9:,.1f} GFLOP/s"
        + ("" if sheet is None else f" (data sheet {sheet / 1e12:,.1f} TFLOP/s)"),
        flush=True,
    )
    return {"counted": COUNTED, "matmul": matmul, "datasheet_flop_per_s": sheet}


def add_mfu(row: dict, flops: dict[str, int], peaks: dict) -> None:
    """Write each side's counted GFLOP a step, TFLOP/s achieved and MFU into ``row`` (which has
    ``ours_ms`` and ``torch_ms``): ``ours_mfu`` against the measured peak and, where a data
    sheet's peak is known, ``ours_mfu_datasheet``; the same for ``torch``."""
    for side, counted in flops.items():
        achieved = counted / (row[f"{side}_ms"] / 1e3)
        row[f"{side}_gflop"] = counted / 1e9
        row[f"{side}_tflop_per_s"] = achieved / 1e12
        row[f"{side}_mfu"] = achieved / peaks["matmul"]["flop_per_s"]
        if peaks["datasheet_flop_per_s"] is not None:
            row[f"{side}_mfu_datasheet"] = achieved / peaks["datasheet_flop_per_s"]
