"""Triton kernels of the decoder's step on a GPU: the additive attention scores
(fused_scores.py) and the LSTM cell (lstm_cell.py). gpu_kernels.py says when they run.

    e_ti = w^T tanh(x_ti),   x_ti = p_i + u_t,   p = W_a a + b (G, L, A),   u_t = U_a h_{t-1}

Each score kernel reads p once and keeps x, tanh(x) and their gradients in registers: by
autograd the same work is 14 passes over a (G, L, A) tensor per word. The cell's kernels do a
word's 6 operations forward and 10 backward in one launch each, recomputing the gates'
activations backward rather than storing them.

tanh(x) is taken as 2 sigmoid(2x) - 1 and its derivative as 4 s (1 - s), s = sigmoid(2x):
Triton's language has a sigmoid on every version the project supports, and 4 s (1 - s) keeps
its precision where tanh(x) is near +-1.

Rows of u come in groups of ``K`` per image (beams): row n = g K + k reads image g's keys.
The kernels take any row stride for u (U_a h is a column slice of a wider matmul's output);
the other tensors are contiguous. Sums are in float32 whatever the inputs' dtype.

Importing this module imports Triton: gpu_kernels.py imports it on first use only, so that
captioning on a CPU never pays for it.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK_L = 32  # grid locations per tile
BLOCK_A = 128  # attention channels per tile
BLOCK_H = 128  # LSTM units per program
WARPS = 4


def _on(x: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it x's (`--device cuda:1`)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


@triton.jit
def _tanh_parts(x):
    s = tl.sigmoid(2.0 * x)
    return 2.0 * s - 1.0, 4.0 * s * (1.0 - s)  # tanh(x), tanh'(x)


@triton.jit
def _scores_kernel(
    p_ptr, u_ptr, w_ptr, e_ptr, L, A, K, u_stride, BL: tl.constexpr, BA: tl.constexpr
):
    """e[n, l] for one row n and BL locations: grid (K, cdiv(L, BL), G), so that the K rows
    of one image run side by side and read its keys from the cache."""
    k, lb, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = g * K + k
    ls = lb * BL + tl.arange(0, BL)
    acc = tl.zeros((BL,), dtype=tl.float32)
    for a0 in range(0, A, BA):
        a = a0 + tl.arange(0, BA)
        mask = (ls[:, None] < L) & (a[None, :] < A)
        p = tl.load(p_ptr + (g * L + ls[:, None]) * A + a[None, :], mask=mask, other=0.0)
        u = tl.load(u_ptr + n * u_stride + a, mask=a < A, other=0.0)
        w = tl.load(w_ptr + a, mask=a < A, other=0.0)
        t, _ = _tanh_parts(p.to(tl.float32) + u.to(tl.float32)[None, :])
        acc += tl.sum(t * w.to(tl.float32)[None, :], axis=1)
    tl.store(e_ptr + n * L + ls, acc, mask=ls < L)


@triton.jit
def _hidden_grad_kernel(
    p_ptr, u_ptr, w_ptr, ge_ptr, gu_ptr, L, A, K, u_stride, BL: tl.constexpr, BA: tl.constexpr
):
    """d e / d u for one row n and BA channels: sum_l ge[n, l] w tanh'(p_l + u_n).
    Grid (cdiv(A, BA), K, G)."""
    ab, k, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = g * K + k
    a = ab * BA + tl.arange(0, BA)
    u = tl.load(u_ptr + n * u_stride + a, mask=a < A, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + a, mask=a < A, other=0.0).to(tl.float32)
    acc = tl.zeros((BA,), dtype=tl.float32)
    for l0 in range(0, L, BL):
        ls = l0 + tl.arange(0, BL)
        mask = (ls[:, None] < L) & (a[None, :] < A)
        p = tl.load(p_ptr + (g * L + ls[:, None]) * A + a[None, :], mask=mask, other=0.0)
        ge = tl.load(ge_ptr + n * L + ls, mask=ls < L, other=0.0).to(tl.float32)
        _, dt = _tanh_parts(p.to(tl.float32) + u[None, :])
        acc += tl.sum(ge[:, None] * dt, axis=0)
    tl.store(gu_ptr + n * A + a, acc * w, mask=a < A)


@triton.jit
def _keys_grad_kernel(
    p_ptr, u_ptr, ge_ptr, w_ptr, gp_ptr, gw_ptr, L, A, K, N, T,
    BL: tl.constexpr, BA: tl.constexpr,
):  # fmt: skip
    """The gradients of p and w over all T words of a pass, for one tile of one image:
    gp[l, a] = w_a sum_t,k ge[t, n, l] tanh'(x), and this tile's share of
    gw[a] = sum_t,k,l ge[t, n, l] tanh(x) (summed over tiles by the caller).
    u (T, N, A) and ge (T, N, L) are contiguous. Grid (cdiv(L, BL), cdiv(A, BA), G)."""
    lb, ab, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ls = lb * BL + tl.arange(0, BL)
    a = ab * BA + tl.arange(0, BA)
    mask = (ls[:, None] < L) & (a[None, :] < A)
    tile = (g * L + ls[:, None]) * A + a[None, :]
    p = tl.load(p_ptr + tile, mask=mask, other=0.0).to(tl.float32)
    acc_p = tl.zeros((BL, BA), dtype=tl.float32)
    acc_w = tl.zeros((BA,), dtype=tl.float32)
    for t in range(0, T):
        for k in range(0, K):
            n = t * N + g * K + k
            u = tl.load(u_ptr + n * A + a, mask=a < A, other=0.0).to(tl.float32)
            ge = tl.load(ge_ptr + n * L + ls, mask=ls < L, other=0.0).to(tl.float32)
            th, dt = _tanh_parts(p + u[None, :])
            acc_p += ge[:, None] * dt
            acc_w += tl.sum(ge[:, None] * th, axis=0)
    w = tl.load(w_ptr + a, mask=a < A, other=0.0).to(tl.float32)
    tl.store(gp_ptr + tile, (acc_p * w[None, :]).to(gp_ptr.dtype.element_ty), mask=mask)
    tl.store(gw_ptr + (g * tl.num_programs(0) + lb) * A + a, acc_w, mask=a < A)


def scores(p: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """e (N, L) float32 from p (G, L, A) contiguous, u (N = G K, A; unit column stride), w (A,)."""
    G, L, A = p.shape
    K = u.size(0) // G
    e = torch.empty(u.size(0), L, device=p.device, dtype=torch.float32)
    grid = (K, triton.cdiv(L, BLOCK_L), G)
    with _on(p):
        _scores_kernel[grid](
            p, u, w, e, L, A, K, u.stride(0), BL=BLOCK_L, BA=BLOCK_A, num_warps=WARPS
        )
    return e


def hidden_grad(
    p: torch.Tensor, u: torch.Tensor, w: torch.Tensor, grad_e: torch.Tensor
) -> torch.Tensor:
    """d e / d u (N, A), in u's dtype, from grad_e (N, L) contiguous."""
    G, L, A = p.shape
    K = u.size(0) // G
    gu = torch.empty(u.size(0), A, device=p.device, dtype=torch.float32)
    grid = (triton.cdiv(A, BLOCK_A), K, G)
    with _on(p):
        _hidden_grad_kernel[grid](
            p, u, w, grad_e, gu, L, A, K, u.stride(0), BL=BLOCK_L, BA=BLOCK_A, num_warps=WARPS
        )
    return gu.to(u.dtype)


def keys_grad(
    p: torch.Tensor, us: torch.Tensor, grad_es: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of p (G, L, A; in p's dtype) and w (A,; float32) over T words, from
    us (T, N, A) and grad_es (T, N, L), both contiguous."""
    G, L, A = p.shape
    T, N = us.shape[:2]
    gp = torch.empty_like(p)
    grid = (triton.cdiv(L, BLOCK_L), triton.cdiv(A, BLOCK_A), G)
    gw = torch.empty(G * grid[0], A, device=p.device, dtype=torch.float32)  # one row a tile row
    with _on(p):
        _keys_grad_kernel[grid](
            p, us, grad_es, w, gp, gw, L, A, N // G, N, T, BL=BLOCK_L, BA=BLOCK_A, num_warps=WARPS
        )
    return gp, gw.sum(0)


@triton.jit
def _cell_inputs(gates_ptr, c_ptr, b, j, m, H):
    """Row b's units j (mask m): i, f, o, g = tanh, tanh' of g's pre-activation, c_{t-1}."""
    row = gates_ptr + b * 4 * H + j
    i = tl.sigmoid(tl.load(row, mask=m, other=0.0).to(tl.float32))
    f = tl.sigmoid(tl.load(row + H, mask=m, other=0.0).to(tl.float32))
    o = tl.sigmoid(tl.load(row + 2 * H, mask=m, other=0.0).to(tl.float32))
    g, dg = _tanh_parts(tl.load(row + 3 * H, mask=m, other=0.0).to(tl.float32))
    c = tl.load(c_ptr + b * H + j, mask=m, other=0.0).to(tl.float32)
    return i, f, o, g, dg, c


@triton.jit
def _cell_forward_kernel(gates_ptr, c_ptr, h_out, c_out, H, BH: tl.constexpr):
    """One row's BH units: gates (B, 4H) in the order i f o g, c (B, H). Grid (cdiv(H, BH), B)."""
    hb, b = tl.program_id(0), tl.program_id(1)
    j = hb * BH + tl.arange(0, BH)
    m = j < H
    i, f, o, g, _, c = _cell_inputs(gates_ptr, c_ptr, b, j, m, H)
    c_t = f * c + i * g
    tanh_c, _ = _tanh_parts(c_t)
    tl.store(c_out + b * H + j, c_t.to(c_out.dtype.element_ty), mask=m)
    tl.store(h_out + b * H + j, (o * tanh_c).to(h_out.dtype.element_ty), mask=m)


@triton.jit
def _cell_backward_kernel(
    gates_ptr, c_ptr, gh_ptr, gc_ptr, g_gates, g_c, H, BH: tl.constexpr
):  # fmt: skip
    """d loss / d gates (B, 4H) and d loss / d c_{t-1} (B, H) from those of h_t and c_t."""
    hb, b = tl.program_id(0), tl.program_id(1)
    j = hb * BH + tl.arange(0, BH)
    m = j < H
    i, f, o, g, dg, c = _cell_inputs(gates_ptr, c_ptr, b, j, m, H)
    tanh_c, dtanh_c = _tanh_parts(f * c + i * g)
    grad_h = tl.load(gh_ptr + b * H + j, mask=m, other=0.0).to(tl.float32)
    grad_c = tl.load(gc_ptr + b * H + j, mask=m, other=0.0).to(tl.float32)
    d_c = grad_h * o * dtanh_c + grad_c  # d loss / d c_t
    out = g_gates + b * 4 * H + j
    ty = g_gates.dtype.element_ty
    tl.store(out, (d_c * g * i * (1.0 - i)).to(ty), mask=m)
    tl.store(out + H, (d_c * c * f * (1.0 - f)).to(ty), mask=m)
    tl.store(out + 2 * H, (grad_h * tanh_c * o * (1.0 - o)).to(ty), mask=m)
    tl.store(out + 3 * H, (d_c * i * dg).to(ty), mask=m)
    tl.store(g_c + b * H + j, (d_c * f).to(g_c.dtype.element_ty), mask=m)


def cell_forward(gates: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h_t, c_t (B, H), in the promoted dtype of gates (B, 4H) and c (B, H), both contiguous."""
    B, H = c.shape
    dtype = torch.promote_types(gates.dtype, c.dtype)
    h_t, c_t = (torch.empty(B, H, device=c.device, dtype=dtype) for _ in range(2))
    grid = (triton.cdiv(H, BLOCK_H), B)
    with _on(gates):
        _cell_forward_kernel[grid](gates, c, h_t, c_t, H, BH=BLOCK_H, num_warps=WARPS)
    return h_t, c_t


def cell_backward(
    gates: torch.Tensor, c: torch.Tensor, grad_h: torch.Tensor, grad_c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of gates (in its dtype) and c_{t-1} (in its dtype); all contiguous."""
    B, H = c.shape
    g_gates, g_c = torch.empty_like(gates), torch.empty_like(c)
    grid = (triton.cdiv(H, BLOCK_H), B)
    with _on(gates):
        _cell_backward_kernel[grid](
            gates, c, grad_h, grad_c, g_gates, g_c, H, BH=BLOCK_H, num_warps=WARPS
        )
    return g_gates, g_c
