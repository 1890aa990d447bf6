"""Errors that mean 'bad input': the CLI prints their one-line message instead of a traceback."""

from showattendtell.data.datasets import DatasetError
from showattendtell.images import ImageError
from showattendtell.metrics import MetricsError
from showattendtell.model_file import ModelFileError

USER_ERRORS = (DatasetError, ImageError, MetricsError, ModelFileError, FileNotFoundError)
