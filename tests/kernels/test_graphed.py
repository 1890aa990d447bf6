"""What CUDA graphs need of the training step and the search, checked on a CPU: fixed shapes
(padded captions give the same losses: tests/network/test_decoder.py), no host synchronisation in
the
forward pass and the losses, and the wrappers' plumbing (on a CPU nothing can be recorded: the
objective or the search runs itself, with the same results)."""

import contextlib

import pytest
import torch
from helpers import count_host_syncs, make_batch, small_decoder

from showattendtell.kernels.graphed import GraphedObjective, pad_captions
from showattendtell.network.vocab import PAD
from showattendtell.training.losses import hard_attention_loss, soft_attention_loss
from showattendtell.training.objectives import MaximumLikelihood


class Model(torch.nn.Module):  # what an objective reads of the CaptionModel
    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder


class FixedShape(torch.nn.Module):  # the recurrence a GPU runs, on a CPU
    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, *args, **kwargs):
        return self.decoder(*args, fixed_shape=True, **kwargs)


def test_captions_longer_than_the_padded_length_are_refused():
    with pytest.raises(ValueError, match="do not fit"):
        pad_captions(torch.zeros(2, 9, dtype=torch.long), 8, PAD)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_fixed_shape_training_pass_never_waits_for_the_device(monkeypatch, attention):
    """The forward pass, the losses and the backward pass (written-out parts included:
    deferred_linear.py, lstm_cell.py) read no value back to the host: a CUDA graph holds them."""
    a, caps, lengths = make_batch(B=4, T=6)
    dec = small_decoder(attention=attention)
    calls = count_host_syncs(monkeypatch)
    out = dec(a, caps, lengths, mode="sample" if attention == "hard" else "expectation",
              fixed_shape=True)  # fmt: skip
    if attention == "hard":
        hard_attention_loss(out, 4, 0.1).loss.backward()
    else:
        soft_attention_loss(out, 4, 1.0, 0.1, 0.1).loss.backward()
    batch = {"captions": caps, "lengths": lengths}
    MaximumLikelihood(attention_entropy=0.1)(Model(FixedShape(dec)), a, batch)
    assert calls == []
    dec(a, caps, lengths, fixed_shape=False)  # the shrinking recurrence: counted
    assert calls


def test_graphed_objective_gives_the_objectives_loss_logs_and_gradients():
    a, caps, lengths = make_batch(B=4, T=6)
    model, objective = Model(small_decoder(seed=5)), MaximumLikelihood(attention_entropy=0.1)
    batch = {"captions": caps, "lengths": lengths}
    loss, logs = objective(model, a, batch)
    expected = torch.autograd.grad(loss, list(model.parameters()))
    for tokens in (None, 12):
        got, got_logs = GraphedObjective(objective, model, tokens, PAD)(a, batch)
        assert torch.allclose(got, loss, atol=1e-6)
        assert list(got_logs) == list(logs)
        for k, v in logs.items():
            assert torch.allclose(got_logs[k], v, atol=1e-6), k
        grads = torch.autograd.grad(got, list(model.parameters()))
        for x, y in zip(grads, expected, strict=True):
            assert torch.allclose(x, y, rtol=1e-4, atol=1e-6)


def test_a_search_graph_that_cannot_be_recorded_runs_the_search_itself():
    """Recording needs a CUDA GPU: a failed recording runs the function directly, with its own
    results; after MAX_FAILURES of them, one warning, and no more attempts."""
    from showattendtell.kernels.graphed import MAX_FAILURES, GraphedFunction

    calls = []

    def fn(x):
        calls.append(1)
        return (x * 2, x.sum(0))

    graphed = GraphedFunction(fn)
    x = torch.arange(6.0).view(3, 2)
    results = [graphed(x, key=(i,)) for i in range(MAX_FAILURES - 1)]
    with pytest.warns(UserWarning, match="without CUDA graphs"):
        results.append(graphed(x, key=("last try",)))
    results.append(graphed(x, key=("no more tries",)))
    assert graphed.failures == MAX_FAILURES and graphed.graphs == {}
    for got in results:
        assert torch.equal(got[0], x * 2) and torch.equal(got[1], x.sum(0))


def test_search_graphs_are_dropped_when_the_weights_change():
    """Between validations the weights change: the graphs recorded against the old ones (and
    the GPU memory they hold) go, rather than waiting to be evicted."""
    from showattendtell.kernels.graphed import GraphedFunction

    graphed = GraphedFunction(lambda x: (x,))
    graphed.forget_unless(("weights", 1))
    graphed.graphs[("batch 128",)] = ("a recorded graph",)
    graphed.forget_unless(("weights", 1))
    assert ("batch 128",) in graphed.graphs
    graphed.forget_unless(("weights", 2))
    assert graphed.graphs == {} and graphed.state == ("weights", 2)


def test_a_batch_is_padded_to_the_smallest_recorded_graph_that_holds_it():
    """Recording a graph takes up to half a second on a GPU, replaying a larger one
    milliseconds: a batch finds the graphs recorded for its options, dtype and grid."""
    from showattendtell.kernels.graphed import GraphedFunction

    graphed = GraphedFunction(lambda x: (x,))

    def record(rows, key, dtype=torch.float32):
        graphed.graphs[graphed._key((torch.zeros(rows, 4, 3, dtype=dtype),), key)] = "a graph"

    record(128, ("greedy", 20))
    record(32, ("greedy", 20))
    record(8, ("beam", 20))  # other options
    record(4, ("greedy", 20), torch.float64)  # another dtype
    graphed.graphs[graphed._key((torch.zeros(2, 5, 3),), ("greedy", 20))] = "another grid"
    assert sorted(graphed.batch_sizes(torch.zeros(16, 4, 3), key=("greedy", 20))) == [32, 128]
    assert graphed.batch_sizes(torch.zeros(16, 4, 3), key=("beam", 20)) == [8]
    assert graphed.batch_sizes(torch.zeros(1, 4, 3), key=("beam", 5)) == []


class FakeGraph:  # torch.cuda.graph's calls, without a GPU
    calls: list[dict] = []

    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        FakeGraph.calls.append({"pool": pool, "capture_error_mode": capture_error_mode})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("fails", [False, True])
def test_an_older_torchs_training_graph_records_in_thread_local_mode(monkeypatch, fails):
    """torch 2.11's make_graphed_callables takes no capture mode and records through
    ``torch.cuda.graph`` in the global one, which a pin-memory thread breaks: for the length of
    the recording that call gets the thread-local mode, and is itself again afterwards."""
    from showattendtell.kernels.graphed import CAPTURE_MODE, thread_local_capture

    def old_make_graphed_callables(callables, sample_args, allow_unused_input=False):
        for _ in ("forward", "backward"):
            with torch.cuda.graph("a CUDAGraph", pool="shared"):
                if fails:
                    raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", FakeGraph)
    FakeGraph.calls = []
    raised = pytest.raises(RuntimeError) if fails else contextlib.nullcontext()
    with raised, thread_local_capture(old_make_graphed_callables) as mode:
        old_make_graphed_callables(None, (), **mode)
    assert mode == {}
    expected = {"pool": "shared", "capture_error_mode": CAPTURE_MODE}
    assert FakeGraph.calls == ([expected] if fails else [expected, expected])
    assert torch.cuda.graph is FakeGraph
    torch.cuda.graph("a CUDAGraph")
    assert FakeGraph.calls[-1]["capture_error_mode"] == "global"


def test_a_newer_torchs_training_graph_is_given_the_mode_itself(monkeypatch):
    from showattendtell.kernels.graphed import CAPTURE_MODE, thread_local_capture

    def make_graphed_callables(callables, sample_args, capture_error_mode="global"):
        pass

    monkeypatch.setattr(torch.cuda, "graph", FakeGraph)
    with thread_local_capture(make_graphed_callables) as mode:
        assert torch.cuda.graph is FakeGraph
    assert mode == {"capture_error_mode": CAPTURE_MODE} and CAPTURE_MODE == "thread_local"
