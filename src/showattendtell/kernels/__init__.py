"""Speed machinery under the network: attention scores and the LSTM cell written out (CPU, Triton),
deferred weight gradients and CUDA graphs. Nothing here changes what the model computes."""
