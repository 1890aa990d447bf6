"""Scoring captions: the COCO caption metrics and attention correctness."""
