"""The network of Show, Attend and Tell: the CNN encoder, the attention, the LSTM decoder and the
vocabulary."""
