"""`sat caption --engine ray` against `sat caption` in one process, on the same photos in the
same run: photos/s once running, and the start-up (from the command to the first record).

Each command runs as a child process writing JSON Lines; the output file is polled (every 20 ms)
for its line count. Start-up: the time to the first record. Once running: the records after the
first over the time from the first record to the last. The Ray engine starts its own Ray
instance on this machine (no --address) unless ``--address`` is given. The two runs alternate
(``--rounds``) so that a change in the machine's load hits both alike; medians are reported.

    python benchmarks/ray_caption.py --images ../shared/data/flickr8k/images --photos 1000
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed_run(command: list[str], out: Path, photos: int, stdin) -> dict:
    """Run ``command`` (which writes ``out``, the paths on ``stdin``); the start-up and the rate
    once running."""
    start = time.monotonic()
    proc = subprocess.Popen(
        command, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    first = None
    lines = 0
    while proc.poll() is None:
        if out.is_file():
            lines = lines_in(out)
            if lines and first is None:
                first = (time.monotonic(), lines)
        time.sleep(0.02)
    end = time.monotonic()
    err = proc.stderr.read()
    if proc.returncode not in (0, 1) or not out.is_file() or lines_in(out) != photos:
        sys.exit(f"{' '.join(command)} failed ({proc.returncode}):\n{err[-2000:]}")
    if first is None:  # finished between two polls
        first = (end, photos)
    t_first, n_first = first
    rate = (photos - n_first) / (end - t_first) if end > t_first else float("nan")
    return {"startup_s": t_first - start, "photos_per_s": rate, "total_s": end - start}


def lines_in(path: Path) -> int:
    return path.read_bytes().count(b"\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--images", type=Path, required=True, help="a folder of photos")
    p.add_argument("--photos", type=int, default=1000)
    p.add_argument("--model", default=None)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--beam-size", type=int, default=1)
    p.add_argument("--devices", type=int, default=1, help="Ray: captioning actors")
    p.add_argument("--address", default=None, help="Ray: a cluster to join")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument(
        "--engines", nargs="+", choices=("one process", "ray"), default=["one process", "ray"]
    )
    a = p.parse_args()
    photos = sorted(a.images.glob("*.jpg"))[: a.photos]
    if len(photos) < a.photos:
        sys.exit(f"{a.images}: {len(photos)} photos, not {a.photos}")
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "photos.txt"
        listing.write_text("".join(f"{x}\n" for x in photos))
        base = [sys.executable, "-m", "showattendtell.cli", "caption", "-"]
        base += ["--batch-size", str(a.batch_size), "--beam-size", str(a.beam_size)]
        if a.model:
            base += ["--model", a.model]
        ray = ["--engine", "ray"] + (["--devices", str(a.devices)] if a.devices > 1 else [])
        ray += ["--address", a.address] if a.address else []
        runs: dict[str, list[dict]] = {name: [] for name in a.engines}
        for r in range(a.rounds):
            for name, extra in (("one process", []), ("ray", ray)):
                if name not in a.engines:
                    continue
                out = Path(tmp) / f"{name.replace(' ', '-')}-{r}.jsonl"
                with open(listing) as stdin:
                    command = [*base, "-o", str(out), *extra]
                    runs[name].append(timed_run(command, out, len(photos), stdin))
                print(name, json.dumps(runs[name][-1]), file=sys.stderr)
    summary = {
        name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()
    }
    print(f"{'':12} {'start-up':>10} {'photos/s once running':>22} {'total':>8}")
    for name, s in summary.items():
        print(f"{name:12} {s['startup_s']:9.1f}s {s['photos_per_s']:22.2f} {s['total_s']:7.1f}s")
    ratio = None
    if len(summary) == 2:
        ratio = summary["ray"]["photos_per_s"] / summary["one process"]["photos_per_s"]
        print(f"ray / one process, once running: {ratio:.0%}")
    print(json.dumps({"photos": len(photos), "ratio": ratio, **summary}))


if __name__ == "__main__":
    main()
