"""Chapter 12: numeric precision — which float type the forward pass computes in, and the
loss scaling that float16 needs.

``--precision`` is one of :data:`PRECISIONS`; :func:`resolve_precision` turns ``"auto"`` into
what the device does best:

- a CUDA GPU with native bfloat16 (Ampere and later: A100, H100, RTX 30xx) → ``"bf16"``: the
  same exponent range as float32, so gradients neither underflow nor need scaling;
- any other CUDA GPU (T4, V100) → ``"fp16"``, with a :class:`torch.amp.GradScaler` that scales
  the loss up before ``backward`` so small gradients survive float16's narrow range, and skips
  the steps whose gradients overflowed;
- a CPU (or Apple's MPS) → ``"fp32"``.

``"bf16"`` and ``"fp16"`` may also be asked for on a CPU (CPU autocast supports both); the tests
use that to run both mixed-precision paths without a GPU. Under autocast the model's matrix
products run in the half type while the weights, the optimizer and the loss stay float32
(:func:`transformer_tutorial.optim.translation_loss` computes in float32).
"""

from __future__ import annotations

import torch

from transformer_tutorial.checks import check_choice

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """``precision`` as ``"fp32"``, ``"bf16"`` or ``"fp16"`` on ``device``: ``"auto"`` is bf16
    on a CUDA GPU with native bfloat16, fp16 on other CUDA GPUs, fp32 elsewhere."""
    check_choice("precision", precision, PRECISIONS)
    device = torch.device(device)
    if precision != "auto":
        return precision
    if device.type != "cuda":
        return "fp32"
    # Without including_emulation=False, a T4 answers True: bf16 would run, emulated and slow.
    return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"


def autocast(precision: str, device: torch.device | str) -> torch.autocast:
    """The context the forward pass runs in: autocast to the half type, or off for fp32."""
    device = torch.device(device)
    dtype = DTYPES[resolve_precision(precision, device)]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def grad_scaler(precision: str, device: torch.device | str) -> torch.amp.GradScaler:
    """A loss scaler, enabled for fp16 only; a disabled one passes the loss and the optimizer
    step through unchanged, so the training step has one code path for every precision."""
    device = torch.device(device)
    enabled = resolve_precision(precision, device) == "fp16"
    return torch.amp.GradScaler(device.type, enabled=enabled)
