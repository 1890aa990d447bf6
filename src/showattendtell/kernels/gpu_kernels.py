"""When the decoder's step takes its Triton kernels (triton_kernels.py): the attention scores
(fused_scores.py) and the LSTM cell (lstm_cell.py).

On CUDA devices where Triton imports and compiles, for float32, bf16 and float16 tensors,
outside torch.compile (which fuses the plain operations itself). Where Triton is missing or
fails (no compiler, an unsupported GPU), one warning a device, and autograd's operations.
``SAT_TRITON=0`` in the environment turns the kernels off (the same values, PyTorch's
operations), should they misbehave on some GPU.
"""

from __future__ import annotations

import functools
import os
import warnings
from types import ModuleType

import torch

# device types that take the kernels (tests add "cpu": Triton's interpreter)
FUSED_DEVICES = set() if os.environ.get("SAT_TRITON") == "0" else {"cuda"}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WARNED: set[str] = set()  # devices where the kernels did not run, and a warning said so


def applies(x: torch.Tensor) -> bool:
    """Whether operations on ``x`` take the kernels (checking, once a process and device,
    that Triton runs there: its backward kernels too when a gradient is wanted)."""
    if x.device.type not in FUSED_DEVICES or x.dtype not in DTYPES:
        return False
    if torch.compiler.is_compiling():
        return False
    return _runs(x.device, torch.is_grad_enabled())


def kernels() -> ModuleType:
    """triton_kernels, imported on first use: importing Triton takes a while."""
    from showattendtell.kernels import triton_kernels

    return triton_kernels


@functools.cache
def _runs(device: torch.device, backward: bool) -> bool:
    """Runs the kernels once on small tensors: the backward ones only when a gradient is
    wanted, since each compiles for a while the first time on a machine."""
    try:
        k = kernels()
        p, u, w = (torch.randn(*s, device=device) for s in ((2, 3, 5), (2, 5), (5,)))
        gates, c = torch.randn(2, 12, device=device), torch.randn(2, 3, device=device)
        e = k.scores(p, u, w)
        k.cell_forward(gates, c)
        if backward:
            k.hidden_grad(p, u, w, e)
            k.keys_grad(p, u.unsqueeze(0), e.unsqueeze(0), w)
            k.cell_backward(gates, c, c, c)
        return True
    except Exception as error:  # Triton missing, no compiler, an unsupported GPU: all alike
        if str(device) not in _WARNED:
            _WARNED.add(str(device))
            warnings.warn(
                f"the decoder's step by autograd on {device}: its fused kernels do not run "
                f"there ({type(error).__name__}: {error})",
                stacklevel=3,
            )
        return False
