"""How Lightning reads the checkpoint a run resumes from: through read_checkpoint (no code the
file names is run; one line for a file that is not a checkpoint of sat train).

Lightning reads it itself for ``--ckpt_path last`` and ``hpc`` and a SLURM requeue, with
torch's default, which ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns into running the file's
code. A CheckpointIO plugin is the one place every one of its reads goes through (the
strategies' ``load_checkpoint``), whichever Lightning version passes which arguments.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from showattendtell.training.lit_module import read_checkpoint


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO (it still writes the checkpoints), reading them as
    read_checkpoint does: on the CPU (Lightning moves the tensors where the run needs them)."""

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: Any = None):
        return read_checkpoint(path, "--ckpt_path")
