"""Peak memory of decoding one image (images.files.open_image), in a fresh process each.

A large but tiny-on-disk image (a PNG of one grey level compresses to almost nothing) is what
an upload limit by file size lets through: what decoding it costs is what matters. Each case
runs in its own process and reports the rise of the peak resident set (ru_maxrss) across one
``open_image`` call (``--threads N``: N at once), after the imports.

    python benchmarks/decode_memory.py --side 8000 --threads 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import resource, sys, threading
from showattendtell.images.files import open_image
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
n = int(sys.argv[2])
threads = [threading.Thread(target=open_image, args=(sys.argv[1],)) for _ in range(n)]
for t in threads:
    t.start()
for t in threads:
    t.join()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) // 1024)
"""


def write_cases(folder: Path, side: int) -> dict[str, Path]:
    """A 16-bit greyscale PNG and an 8-bit RGB PNG of side x side pixels, one level each."""
    import numpy as np
    from PIL import Image

    cases = {"16-bit grey PNG": folder / "grey16.png", "8-bit RGB PNG": folder / "rgb8.png"}
    Image.fromarray(np.full((side, side), 30000, dtype=np.uint16)).save(cases["16-bit grey PNG"])
    Image.new("RGB", (side, side), (120, 90, 60)).save(cases["8-bit RGB PNG"])
    return cases


def peak_rise_mb(path: Path, threads: int) -> int:
    """The rise in MB of the peak resident set of a fresh process decoding ``path`` in
    ``threads`` threads at once (as the web service's workers may)."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), str(threads)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=8000, help="image side in pixels")
    parser.add_argument("--threads", type=int, default=1, help="decode it in N threads at once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cases = write_cases(Path(tmp), args.side)
        results = {}
        for name, path in cases.items():
            peak = peak_rise_mb(path, args.threads)
            results[name] = {"file_kb": path.stat().st_size // 1024, "peak_mb": peak}
            print(f"{name}: {results[name]['file_kb']} KB file, +{results[name]['peak_mb']} MB")
    print(json.dumps({"side": args.side, "threads": args.threads, **results}))


if __name__ == "__main__":
    main()
