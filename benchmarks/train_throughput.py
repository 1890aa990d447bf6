"""Decoder training throughput on cached-feature-shaped inputs.

Times the full training step (forward, loss with the doubly stochastic / REINFORCE terms,
backward, Adam step) of the optimised decoder and of the peer, sgrvinod's DecoderWithAttention
with its own training step (tests/oracles/peer.py), on the same batch, and the machine's fp32
matmul rate in the same run. ``--precision bf16`` runs both under bf16 autocast. Prints a
table, then one JSON object as the last line. Run from the repository root, as a module (the
peer lives with the tests' oracles):

    python -m benchmarks.train_throughput --grid 14 --feature-dim 2048 --batch 64 --vocab 10000
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from showattendtell.kernels import gpu_kernels
from showattendtell.kernels.graphed import GraphedLoss
from showattendtell.network import attention
from showattendtell.network.decoder import Decoder, DecoderConfig
from showattendtell.training.losses import hard_attention_loss, soft_attention_loss

try:
    from benchmarks.caption_throughput import peak_memory_mb
    from tests.oracles.peer import PeerDecoder, peer_loss
except ModuleNotFoundError:  # run as a script: the tests' package is not importable
    raise SystemExit(
        "error: run this benchmark from the repository root as "
        "python -m benchmarks.train_throughput"
    ) from None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_gflops(device: torch.device, sizes=(2048, 4096), reps: int = 8) -> float:
    """The machine's fp32 matmul rate: the best of repeated large square matmuls (its
    practical peak; the best, not the median, because other processes only slow it down)."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
        a @ b
        sync(device)
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            sync(device)
            best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def make_batch(B, L, D, V, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(B, L, D, generator=g).relu()  # ReLU features, like a CNN's
    words = torch.randint(13, 20, (B,), generator=g)  # 13-19 words, as in COCO / Flickr8k
    T = int(words.max()) + 2
    caps = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(words.tolist()):
        caps[b, 0], caps[b, n + 1] = 1, 2
        caps[b, 1 : n + 1] = torch.randint(4, V, (n,), generator=g)
    return feats.to(device), caps.to(device), (words + 1).to(device)


def flops_per_token(cfg: DecoderConfig, L: int, D: int, V: int, tokens_per_caption: float):
    """Matmul FLOPs of one training token: 3x the forward (backward costs about twice)."""
    E, H, A = cfg.embed_dim, cfg.hidden_dim, cfg.attention_dim
    per_caption = 2 * L * D * A + 2 * 2 * D * H  # W_a a (once per caption), h0 and c0
    per_token = 2 * (
        H * (4 * H + A + 1) + L * A + L * D + D * 4 * H + E * 4 * H + H * E + D * E + E * V
    )
    return 3 * (per_token + per_caption / tokens_per_caption)


def time_steps(steps: dict, device, warmup: int, reps: int) -> tuple[dict[str, float], dict]:
    """Median seconds per step of each named step, and the peak memory after the first one's
    warm-up steps (before any other step ran). After ``warmup`` steps each, the steps take
    turns (a, b, a, b, ...): this machine's speed drifts by 15 % between runs and within one,
    and taken in turn both steps see the same drift, so their ratio holds still."""
    peak = None
    for step in steps.values():
        for _ in range(warmup):
            step()
        sync(device)
        peak = peak_memory_mb(device) if peak is None else peak
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            t = time.perf_counter()
            step()
            sync(device)
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}, peak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", type=int, default=14)
    p.add_argument("--feature-dim", type=int, default=2048)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--attention", choices=("soft", "hard"), default="soft")
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--hidden-dim", type=int, default=512)
    p.add_argument("--attention-dim", type=int, default=512)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: both steps under bf16 autocast (bf16-mixed training)",
    )
    p.add_argument(
        "--strategy",
        choices=("auto", "fixed", "packed"),
        default="auto",
        help="the decoder's training recurrence (Decoder.forward's fixed_shape)",
    )
    p.add_argument(
        "--step",
        choices=("auto", "autograd"),
        default="auto",
        help="the decoder's step as the device takes it (a CPU's attention scores a few images "
        "at a time, piecewise_scores.py; a GPU's Triton kernels, gpu_kernels.py) or by "
        "autograd's operations alone",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="our forward pass through torch.compile (the fixed-shape recurrence, unrolled)",
    )
    p.add_argument(
        "--no-graphs",
        action="store_true",
        help="on a GPU, run our step without CUDA graphs (graphed.py), kernel by kernel",
    )
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--no-baseline", action="store_true", help="skip the peer")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="after the timing, profile this many of our steps (torch.profiler): on a GPU the "
        "kernels a step runs and how much of the step the GPU is busy, on a CPU the operators",
    )
    p.add_argument(
        "--matmul-sizes",
        default="2048,4096",
        help="square matmuls that measure the machine's peak (comma-separated)",
    )
    return p.parse_args(argv)


def train_step(
    model: torch.nn.Module, loss_fn, device: torch.device, precision: str, fused: bool = False
):
    """One optimiser step of ``model`` on ``loss_fn()``, under autocast for bf16. ``fused``:
    Adam's update as one pass over the parameters (what `sat train` uses); the peer keeps its
    own training step's Adam."""
    opt = torch.optim.Adam(model.parameters(), lr=2e-4, fused=fused or None)

    def step() -> None:
        with torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16"):
            loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one of the (start, end) intervals: the GPU's busy time
    (kernels on several streams may overlap, so their durations do not simply add up)."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def profile_steps(step, device: torch.device, steps: int, top: int = 12) -> dict:
    """Where ``steps`` of our training steps spend their time, by torch.profiler, per step.

    Why: at batch 64 the GPU step is bound by fixed costs, not arithmetic (benchmarks/README.md),
    and which of them is the question: gaps between kernels (launches, the host) show as a GPU
    busy for less than the step's time; many small kernels as the kernel count; a slow kernel
    at the top of the list. On a CPU the same table lists operators by their own time.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        wall = time.perf_counter() - t
    kind = DeviceType.CUDA if gpu else DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind]
    if not gpu:  # operators by their own time: a parent's time is its children's too
        events = [e for e in events if e.name.startswith("aten::")]
    totals: dict[str, list[float]] = {}
    for e in events:
        us = e.time_range.elapsed_us() if gpu else e.self_cpu_time_total
        entry = totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += us
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    out = {
        "steps": steps,
        "wall_ms_per_step": round(wall * 1000 / steps, 2),
        "per_step": "kernels" if gpu else "aten operators",
        "count_per_step": round(len(events) / steps, 1),
        "top": [[name[:80], round(n / steps, 1), round(us / steps, 1)] for name, (n, us) in ranked],
    }
    if gpu:
        busy = _union_us([(e.time_range.start, e.time_range.end) for e in events])
        out["gpu_busy_ms_per_step"] = round(busy / 1000 / steps, 2)
    return out


def print_profile(prof: dict) -> None:
    """``profile_steps``'s table: each name's calls and microseconds a step."""
    busy = prof.get("gpu_busy_ms_per_step")
    print(
        f"profile, {prof['steps']} steps: {prof['wall_ms_per_step']} ms a step, "
        f"{prof['count_per_step']} {prof['per_step']} a step"
        + (f", the GPU busy {busy} ms of it" if busy is not None else "")
    )
    for name, calls, us in prof["top"]:
        print(f"  {us:>10.1f} us {calls:>7.1f} x  {name}")


def step_taken(device: torch.device, asked: str) -> str:
    """How the decoder's step ran: "pieces" (a CPU's scores), "triton" or "autograd"."""
    probe = torch.empty(1, 1, 1, device=device)
    if asked == "auto" and attention._piecewise(probe):
        return "pieces"
    return "triton" if asked == "auto" and gpu_kernels.applies(probe) else "autograd"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.step == "autograd":
        attention.PIECEWISE_ON_CPU, gpu_kernels.FUSED_DEVICES = False, set()
    torch.manual_seed(0)
    random.seed(0)
    L, D, B, V = args.grid**2, args.feature_dim, args.batch, args.vocab
    cfg = DecoderConfig(args.attention, args.embed_dim, args.hidden_dim, args.attention_dim, 0.5)
    dec = Decoder(V, D, cfg).to(device).train()
    feats, caps, lengths = make_batch(B, L, D, V, device)
    n_tokens = int(lengths.sum())
    fixed = {"auto": None, "fixed": True, "packed": False}[args.strategy]
    forward = dec
    if args.compile:  # compiled once for these shapes: the same T every step
        fixed, forward = True, torch.compile(dec)
    graphs = device.type == "cuda" and not args.no_graphs and not args.compile

    def loss(decoder, feats, caps, lengths) -> tuple[torch.Tensor]:
        if args.attention == "soft":
            out = decoder(feats, caps, lengths, fixed_shape=fixed)
            return (soft_attention_loss(out, B).loss,)
        # the REINFORCE pass (the expected-context pass costs the same as soft)
        out = decoder(feats, caps, lengths, mode="sample", fixed_shape=fixed)
        return (hard_attention_loss(out, B, 0.0).loss,)

    if graphs:  # the forward and backward as CUDA graphs, as `sat train` runs them there
        fixed, graphed = True, GraphedLoss(dec, loss)

        def ours() -> torch.Tensor:
            return graphed(feats, caps, lengths)[0]
    else:

        def ours() -> torch.Tensor:
            return loss(forward, feats, caps, lengths)[0]

    peak = matmul_gflops(device, [int(n) for n in args.matmul_sizes.split(",")])
    # as `sat train`: Adam fused in float32 and bf16-mixed alike (lit_module.py)
    steps = {"ours": train_step(dec, ours, device, args.precision, fused=True)}
    if not args.no_baseline:
        peer = PeerDecoder(args.attention_dim, args.embed_dim, args.hidden_dim, V, D).to(device)
        steps["peer"] = train_step(
            peer, lambda: peer_loss(peer, feats, caps, lengths), device, args.precision
        )
    times, memory = time_steps(steps, device, 2 if device.type == "cuda" else 1, args.reps)
    t_fast, t_peer = times["ours"], times.get("peer")
    fpt = flops_per_token(cfg, L, D, V, n_tokens / B)
    tok_s = n_tokens / t_fast
    result = {
        "device": str(device),
        "attention": args.attention,
        "grid": args.grid,
        "feature_dim": D,
        "batch": B,
        "vocab": V,
        "precision": args.precision,
        "strategy": "fixed" if args.compile or graphs else args.strategy,
        "step": step_taken(device, args.step),
        "compiled": args.compile,
        "cuda_graphs": graphs,
        "tokens_per_step": n_tokens,
        "step_ms": round(t_fast * 1000, 1),
        "tokens_per_s": round(tok_s, 1),
        "captions_per_s": round(B / t_fast, 2),
        "flops_per_token": int(fpt),
        "achieved_gflops": round(tok_s * fpt / 1e9, 2),
        "matmul_gflops": round(peak, 1),
        "fraction_of_peak": round(tok_s * fpt / 1e9 / peak, 3),
        "threads": torch.get_num_threads(),
        # the process's peak after our warm-up steps, before the peer's first one
        "peak_rss_mb": memory["peak_rss_mb"],
        **({"peak_gpu_mb": memory["peak_gpu_mb"]} if "peak_gpu_mb" in memory else {}),
    }
    if t_peer is not None:
        result["peer_tokens_per_s"] = round(n_tokens / t_peer, 1)
        result["speedup_vs_peer"] = round(t_peer / t_fast, 2)
    if args.profile:  # after the timing, and never at its cost: a failure is reported
        try:
            result["profile"] = profile_steps(steps["ours"], device, args.profile)
        except Exception as e:  # noqa: BLE001 - the profiler's failure must not lose the timing
            result["profile"] = {"error": f"{type(e).__name__}: {e}"}
    width = max(map(len, result))
    for k, v in result.items():
        if k != "profile":
            print(f"{k:<{width}}  {v}")
    if "top" in result.get("profile", {}):
        print_profile(result["profile"])
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
