"""Plain implementations the library is checked and measured against; not part of the wheel.

``equations``: the decoder's equations written directly from the paper (losses, gradients and
greedy captions of the optimised decoder must equal them); ``search``: plain greedy and beam
search (both search strategies must give their hypotheses); ``peer``: sgrvinod's
DecoderWithAttention, the training benchmark's baseline.

The tests import this package as ``oracles`` (tests/ is on their path); the benchmarks import it
as ``tests.oracles`` and are run as modules from the repository root
(``python -m benchmarks.train_throughput``), where ``tests`` and ``benchmarks`` are namespace
packages: no path is edited and nothing of it ships in the wheel.
"""
