"""Datasets (COCO, Flickr8k/30k), the encoder-feature cache and the Lightning DataModule."""
