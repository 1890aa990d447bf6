"""What every dataset reader returns (a split's captioned photos) and the errors they raise."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from showattendtell.errors import UsageError, UserError

log = logging.getLogger("showattendtell.data.datasets")  # the readers' warnings, as before


@dataclass
class CaptionedImage:
    image_id: str  # unique within the dataset: the file name (Flickr) or the COCO id
    path: Path
    captions: list[str]
    coco_id: int | None = None


@dataclass
class Split:
    """The images of a split whose files exist, plus the annotated ones that are absent.

    ``len(images) + len(missing)`` is the size of the split as published (Flickr8k: 6000 /
    1000 / 1000), whatever part of it is on disk.
    """

    name: str
    images: list[CaptionedImage]
    missing: list[Path] = field(default_factory=list)  # annotated images whose file is absent
    image_dir: Path | None = None  # where the images were looked for (for error messages)
    missing_captions: int = 0

    @property
    def num_captions(self) -> int:
        return sum(len(im.captions) for im in self.images)

    @property
    def num_annotated(self) -> int:
        """Images the annotations list for this split, present or not."""
        return len(self.images) + len(self.missing)

    def require_images(self) -> None:
        """Raise MissingImagesError when none of the split's images is on disk.

        Training and evaluation can work on the part that is present (with the summary
        warning); a split with no image at all is a layout mistake or withheld data.
        """
        if not self.images:
            where = self.image_dir or "the dataset folder"
            raise MissingImagesError(
                f"{self.name}: none of its {len(self.missing)} images is in {where} "
                f"({len(self.missing)} missing); put the image files there (see data/README.md)"
            )


class DatasetError(UserError, ValueError):
    """The dataset folder is not laid out as expected; the message says what to do."""


class SplitError(UsageError, ValueError):
    """A split name the dataset in a folder does not have (a usage error: exit status 2)."""


class MissingImagesError(DatasetError):
    """A split was asked for whose image files are absent (e.g. withheld test images)."""


def finish_split(name: str, candidates: list[CaptionedImage], where: Path, hint: str = "") -> Split:
    """The split of the ``candidates`` whose files exist; one warning counts the others (with
    ``hint``, what to check, and the first of them)."""
    present, missing = [], []
    for im in candidates:
        (present if im.path.is_file() else missing).append(im)
    n_caps = sum(len(im.captions) for im in missing)
    if missing:
        log.warning(
            "%s: skipped %d of %d annotated images (%d captions) whose files are not in %s%s",
            name,
            len(missing),
            len(candidates),
            n_caps,
            where,
            f" (the first: {missing[0].image_id}; {hint})" if hint else "",
        )
    return Split(name, present, [im.path for im in missing], Path(where), n_caps)


def read_text(path: Path) -> str:
    """The UTF-8 text of a dataset file; DatasetError with the line of the first bad byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise DatasetError(
            f"{path} is not UTF-8 text (byte {data[e.start]:#04x} on line {line}): "
            "re-download it or save it as UTF-8"
        ) from None
