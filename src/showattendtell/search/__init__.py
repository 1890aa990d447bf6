"""Caption search: the decoding options (torch-free), greedy and beam search, the consensus index
and familiarity."""
