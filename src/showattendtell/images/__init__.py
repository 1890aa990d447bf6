"""Untrusted image files into encoder input: decoding, the device JPEG path, batches from decoding
processes."""
