"""`sat data coco`: parse the arguments and call the downloader in
:mod:`showattendtell.data.download` (download, verify, unpack; resumable)."""

from __future__ import annotations

import argparse
from pathlib import Path

from showattendtell.data.download import COCO_ARCHIVES, fetch_all, load_manifest, select_archives


def add_parser(sub) -> None:
    p = sub.add_parser(
        "data",
        help="download a dataset: sat data coco --root data/coco",
        description="Download the COCO 2014 images and caption annotations from their official "
        "addresses and Karpathy's split, verify them, resume interrupted downloads, "
        "unpack, and print the command to run next.",
    )
    p.add_argument(
        "dataset",
        choices=("coco",),
        help="coco (Flickr8k/30k need a form on their sites: see data/README.md)",
    )
    p.add_argument("--root", default="data/coco", help="where to put the dataset")
    p.add_argument(
        "--base-url",
        default=None,
        help="fetch every archive from this address instead, at the same paths "
        "(a mirror, or a local server in tests)",
    )
    p.add_argument(
        "--manifest",
        default=None,
        help="JSON {archive name: {size, md5}} overriding the expected sizes/checksums",
    )
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="ARCHIVE",
        choices=[a.name for a in COCO_ARCHIVES],
        help="fetch only these archives (default: all four)",
    )
    p.add_argument(
        "--keep-archives",
        action="store_true",
        help="keep the zip files after unpacking (default: delete them)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=5,
        help="resume attempts after a dropped connection (default 5)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    archives = select_archives(args.only, load_manifest(args.manifest))
    root = Path(args.root)
    fetch_all(
        archives,
        root,
        base_url=args.base_url,
        keep_archives=args.keep_archives,
        retries=args.retries,
    )
    print(f"COCO is ready in {root}:")
    for a in archives:
        print(f"  {root / a.target}/  ({a.name})")
    override = "" if root == Path("data/coco") else f" --data.root {root}"
    print("Next:")
    print(f"  sat features --config configs/coco_soft.yaml{override}")
    print(f"  sat train --config configs/coco_soft.yaml{override}")
    return 0
