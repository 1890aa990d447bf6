"""Work shared by several processes (`sat caption --devices N`, `sat features`), on Lightning's
launcher: ``lightning.fabric.Fabric`` with the DDP strategy starts the processes (by running the
same command again with its rank in the environment, as `sat train --trainer.devices N` does),
or joins the ones torchrun / SLURM started, and sets up torch.distributed (NCCL on GPUs, gloo on
CPU). Each process then runs the one image pipeline (pipeline.py) on its share of the photos.

Fabric rather than ``Trainer.predict`` with a prediction writer: the predict loop would need a
second image pipeline (a DataLoader) beside the one `sat caption` and the feature cache share,
and a writer per process; here every process keeps the pipeline and one process writes.

One process (``Processes(1, 1, ...)``) starts nothing and every collective is the identity, so
the same code serves one process and many.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from showattendtell.errors import UsageError


def accelerator_for(device: str) -> str:
    """The Lightning accelerator of a `--device` value: auto -> cuda when there is a GPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device in ("cpu", "cuda"):
        return device
    raise UsageError(
        f"--device {device} names one device; with --devices N say --device cuda "
        "(the N processes take GPUs 0..N-1; CUDA_VISIBLE_DEVICES picks others) or "
        "--device cpu"
    )


def share_batches(n: int, batch_size: int, rank: int, world: int) -> tuple[list[range], list[int]]:
    """Batch ``g`` of the ``n`` inputs goes to process ``g % world``: (every batch, as ranges of
    input positions; the batches of ``rank``). Step ``s`` of every process handles batches
    ``s * world ... s * world + world - 1``, so the first process receives them in input order
    and what it writes is in input order, whatever the number of processes."""
    batches = [range(i, min(i + batch_size, n)) for i in range(0, n, batch_size)]
    return batches, list(range(rank, len(batches), world))


class Processes:
    """This process's place among ``devices`` x ``num_nodes`` processes, and the collectives
    the callers need: ``broadcast`` (from rank 0) and ``gather`` (to rank 0)."""

    def __init__(self, devices: int, num_nodes: int, accelerator: str):
        if devices < 1 or num_nodes < 1:
            raise UsageError("--devices and --num-nodes must be at least 1")
        self.fabric = None
        if devices * num_nodes > 1:
            from lightning.fabric import Fabric

            try:
                self.fabric = Fabric(
                    accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy="ddp"
                )
            except (ValueError, RuntimeError) as e:  # more GPUs than there are, no GPU at all
                raise UsageError(
                    f"cannot start {devices} processes on {accelerator}: {str(e).splitlines()[0]}"
                ) from None

    @property
    def rank(self) -> int:
        """The global rank; known before ``launch`` (the launcher puts it in the environment)."""
        return self.fabric.global_rank if self.fabric else 0

    @property
    def world_size(self) -> int:
        return self.fabric.world_size if self.fabric else 1

    @property
    def local_world_size(self) -> int:
        """Processes on this machine: they share its cores."""
        if self.fabric is None:
            return 1
        return self.world_size // max(1, self.fabric.strategy.num_nodes)

    @property
    def started_externally(self) -> bool:
        """True under torchrun or SLURM: every process runs this command from the start."""
        if self.fabric is None:
            return False
        return bool(self.fabric.strategy.cluster_environment.creates_processes_externally)

    def device(self, default: str) -> str:
        """This process's device: cuda:LOCAL_RANK with several GPU processes, else ``default``."""
        return str(self.fabric.device) if self.fabric else default

    def launch(self) -> None:
        """Start the other processes of this machine (they run the same command line from the
        start) and join the process group. A no-op for one process."""
        if self.fabric is not None:
            # Lightning's banner ("All distributed processes registered ...") is INFO, logged
            # by whichever of its packages was imported last
            for name in ("lightning.fabric", "lightning.pytorch"):
                logging.getLogger(name).setLevel(logging.WARNING)
            self.fabric.launch()

    def close(self) -> None:
        """Leave the process group (an open gloo group aborts the interpreter at exit)."""
        import torch.distributed as dist

        if self.fabric is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def share_cores(self, threads: int | None) -> None:
        """Give each process of this machine its share of the CPU threads (unless ``threads``)."""
        if threads:
            torch.set_num_threads(threads)
        elif self.local_world_size > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.local_world_size))

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every process."""
        return self.fabric.broadcast(obj, src=0) if self.fabric else obj

    def gather(self, obj: Any) -> list[Any] | None:
        """Every process's ``obj`` in rank order on rank 0; None elsewhere."""
        if self.fabric is None:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.fabric is not None:
            self.fabric.barrier()
