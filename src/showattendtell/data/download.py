"""Download, verify and unpack COCO 2014 and Karpathy's split, resumably (`sat data coco`).

Every archive goes through the same steps, each safe to interrupt and rerun:

1. download to ``<root>/downloads/<name>.part``, resuming with an HTTP Range request;
2. verify the size and, where known, the MD5, else the zip's CRCs (``testzip``); a bad archive is
   deleted and the command fails saying so (the next run downloads it afresh);
3. rename to ``<root>/downloads/<name>`` (a file under that name is always a verified archive);
4. unpack into a hidden staging folder, write a ``.sat-complete.json`` marker inside it, then
   rename it to its final name: a dataset folder exists only once it is whole.

Only the standard library is used (urllib), so nothing is installed for a one-off download.
"""

from __future__ import annotations

import errno
import fnmatch
import hashlib
import http.client
import json
import logging
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from showattendtell.errors import UsageError, UserError
from showattendtell.outputs import prepare_folder
from showattendtell.progress import Progress

log = logging.getLogger(__name__)

MARKER = ".sat-complete.json"
CHUNK = 1 << 20
READ = 1 << 16  # network reads: small, so that Ctrl-C on a slow link stops with bytes written
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # retrying cannot help: fail at once
MANIFEST_FIELDS = {"size": int, "md5": str}


class DownloadError(UserError, RuntimeError):
    """A download or unpack step failed; the message says what to do (usually: run again)."""


class DownloadUsageError(DownloadError, UsageError):
    """A bad option or input file (base URL, root folder, manifest): exit status 2, raised
    before anything is downloaded."""


@dataclass(frozen=True)
class Archive:
    """One file to fetch: ``host/path``; unpacked into ``<root>/<target>``.

    ``keep``: glob patterns of the members to unpack (None: all). ``size``/``md5``: the
    published values, None where no reliable value is known (then the zip CRCs are checked).
    """

    name: str
    host: str
    path: str
    target: str
    size: int | None = None
    md5: str | None = None
    keep: tuple[str, ...] | None = None

    def url(self, base_url: str | None = None) -> str:
        return f"{(base_url or self.host).rstrip('/')}/{self.path}"


COCO_HOST = "http://images.cocodataset.org"
KARPATHY_HOST = "https://cs.stanford.edu"

# Sizes and MD5s as published with the COCO 2014 release (and used by torchvision, GluonCV,
# PaddleNLP); no checksum of Karpathy's caption_datasets.zip is published: size unchecked, the
# zip's CRCs are verified instead.
COCO_ARCHIVES = (
    Archive(
        "annotations_trainval2014.zip",
        COCO_HOST,
        "annotations/annotations_trainval2014.zip",
        "annotations",
        252_872_794,
        "0a379cfc70b0e71301e0f377548639bd",
        keep=("annotations/captions_*.json",),
    ),
    Archive(
        "caption_datasets.zip",
        KARPATHY_HOST,
        "people/karpathy/deepimagesent/caption_datasets.zip",
        "caption_datasets",
    ),
    Archive(
        "val2014.zip",
        COCO_HOST,
        "zips/val2014.zip",
        "val2014",
        6_645_013_297,
        "a3d79f5ed8d289b7a7554ce06a5782b3",
    ),
    Archive(
        "train2014.zip",
        COCO_HOST,
        "zips/train2014.zip",
        "train2014",
        13_510_573_713,
        "0da8c0bd3d6becc4dcb32757491aca88",
    ),
)
UNPACKED_FACTOR = 1.01  # JPEG archives barely compress: unpacked ~ archive size


def load_manifest(path: str | None) -> dict[str, dict]:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DownloadUsageError(f"cannot read the manifest {path}: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise DownloadUsageError(f'{path}: a manifest maps archive names to {{"size", "md5"}}')
    unknown = set(data) - {a.name for a in COCO_ARCHIVES}
    if unknown:
        raise DownloadUsageError(f"{path}: unknown archives {sorted(unknown)}")
    for name, entry in data.items():
        problem = _manifest_entry_problem(entry)
        if problem:
            raise DownloadUsageError(f"{path}: the entry {name!r}: {problem}")
    return data


def _manifest_entry_problem(entry: dict) -> str | None:
    """Why an entry is unusable (a string size would only fail mid-download), else None."""
    extra = set(entry) - set(MANIFEST_FIELDS)
    if extra:  # a misspelt "md5" would silently skip the check
        return f"unknown fields {sorted(extra)} (only {sorted(MANIFEST_FIELDS)})"
    size, md5 = entry.get("size"), entry.get("md5")
    if size is not None and (type(size) is not int or size < 0):
        return f'"size" must be a number of bytes or null, not {json.dumps(size)}'
    if md5 is not None and not (
        isinstance(md5, str) and len(md5) == 32 and all(c in "0123456789abcdefABCDEF" for c in md5)
    ):
        return f'"md5" must be 32 hex digits or null, not {json.dumps(md5)}'
    return None


def select_archives(only: list[str] | None, manifest: dict[str, dict]) -> list[Archive]:
    chosen = [a for a in COCO_ARCHIVES if only is None or a.name in only]
    return [
        replace(a, **{k: v for k, v in manifest.get(a.name, {}).items() if k in ("size", "md5")})
        for a in chosen
    ]


def fetch_all(
    archives: list[Archive],
    root: Path,
    base_url: str | None = None,
    keep_archives: bool = False,
    retries: int = 5,
) -> None:
    """Download, verify and unpack every archive not unpacked yet."""
    check_base_url(base_url)
    if not root.is_dir():
        prepare_folder("--root", root)  # made now, or one line saying what is in the way
    todo = [a for a in archives if not is_complete(root / a.target, a)]
    for a in archives:
        if a not in todo:
            log.info("%s: already unpacked in %s", a.name, root / a.target)
    if todo:  # a complete, read-only dataset folder needs no write access
        prepare_folder("--root", root)
        prepare_folder("--root", root / "downloads")
    _check_disk_space(todo, root)
    for a in todo:
        target = root / a.target
        if target.exists():
            raise DownloadError(
                f"{target} exists but was not completely unpacked by `sat data` (no {MARKER}): "
                "move it away or delete it, then run again"
            )
        archive = download(a, root / "downloads", base_url, retries)
        unpack(archive, a, root)
        if not keep_archives:
            archive.unlink()


def check_base_url(base_url: str | None) -> None:
    """A mirror address urllib can fetch from; else urllib's "unknown url type" traceback."""
    if base_url is None:
        return
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise DownloadUsageError(
            f"--base-url {base_url!r}: must be an http(s) address, e.g. http://host:8000/mirror"
        )


def is_complete(target: Path, archive: Archive) -> bool:
    marker = target / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("archive") == archive.name
    except ValueError:
        return False


def _check_disk_space(todo: list[Archive], root: Path) -> None:
    need = 0
    unknown = [a.name for a in todo if a.size is None]
    for a in todo:
        if a.size is None:
            continue
        part = root / "downloads" / f"{a.name}.part"
        have = part.stat().st_size if part.is_file() else 0
        if (root / "downloads" / a.name).is_file():
            have = a.size
        need += (a.size - have) + int(a.size * UNPACKED_FACTOR)
    free = shutil.disk_usage(root).free
    if need > free:
        plus = f" plus the unknown size of {', '.join(unknown)}" if unknown else ""
        raise DownloadError(
            f"{root} has {_bytes(free)} free; downloading and unpacking "
            f"needs about {_bytes(need)}{plus}"
        )


def _bytes(n: int) -> str:
    """A size people read at a glance: never "0.0 GB" for a few megabytes."""
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n:,} bytes"


def _no_space(e: OSError, folder: Path, doing: str, a: Archive, left: int | None) -> DownloadError:
    """The one-line error for a full disk (or quota): what is free and, if known, needed."""
    try:
        free = f"{_bytes(shutil.disk_usage(folder).free)} free"
    except OSError:
        free = "free space unknown"
    need = f"; {a.name} needs about {_bytes(left)} more" if left is not None else ""
    return DownloadError(
        f"{folder}: no space left on the device while {doing} ({e.strerror or e}; {free}{need}): "
        "free some space and run the same command again"
    )


# -- downloading --------------------------------------------------------------------------------


def download(a: Archive, folder: Path, base_url: str | None = None, retries: int = 5) -> Path:
    """The verified archive in ``folder``, downloading (or resuming) it as needed."""
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / a.name
    if final.is_file():
        return final
    part = folder / f"{a.name}.part"
    url = a.url(base_url)
    attempt = 0
    while True:
        try:
            _transfer(url, part, a)
            break
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            if isinstance(e, OSError) and e.errno in NO_SPACE:
                have = part.stat().st_size if part.is_file() else 0
                left = None if a.size is None else a.size - have + int(a.size * UNPACKED_FACTOR)
                doing = f"downloading {a.name} (kept {have:,} bytes)"
                raise _no_space(e, folder, doing, a, left) from None
            if isinstance(e, urllib.error.HTTPError) and e.code != 416 and e.code < 500:
                raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from None
            attempt += 1
            have = part.stat().st_size if part.is_file() else 0
            if attempt > retries:
                raise DownloadError(
                    f"{url}: the transfer broke off at {have:,} bytes ({_reason(e)}); "
                    f"run the same command again to resume from {part}"
                ) from None
            log.warning(
                "%s: transfer broke off at %d bytes (%s); resuming (%d/%d)",
                a.name,
                have,
                _reason(e),
                attempt,
                retries,
            )
            time.sleep(min(2.0**attempt, 30.0) if attempt > 1 else 0.5)
    verify(part, a)
    os.replace(part, final)
    return final


def _reason(e: BaseException) -> str:
    return str(getattr(e, "reason", None) or e) or type(e).__name__


def _transfer(url: str, part: Path, a: Archive) -> None:
    """Append the rest of ``url`` to ``part`` (Range request when part of it is there)."""
    have = part.stat().st_size if part.is_file() else 0
    if a.size is not None and have > a.size:  # not a prefix of this archive: start over
        log.warning("%s: %s is larger than the archive; downloading afresh", a.name, part)
        part.unlink()
        have = 0
    if a.size is not None and have == a.size:
        return
    req = urllib.request.Request(url, headers={"User-Agent": "showattendtell"})
    if have:
        req.add_header("Range", f"bytes={have}-")
    try:
        resp = urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # nothing after `have`: the part is already whole
            return
        raise
    with resp:
        if have and resp.status == 206:
            start = _content_range_start(resp.headers.get("Content-Range", ""))
            if start != have:
                raise DownloadError(f"{url}: the server resumed at byte {start}, not {have}")
            mode = "ab"
            log.info("%s: resuming at %.1f MB", a.name, have / 1e6)
        else:  # 200: the server ignores Range, or nothing was there yet
            mode, have = "wb", 0
        length = resp.headers.get("Content-Length")
        total = have + int(length) if length is not None else a.size
        try:
            with (
                open(part, mode) as f,
                Progress(total, a.name, "B", every_s=30, done=have) as advance,
            ):
                while True:
                    chunk = resp.read(READ)
                    if not chunk:
                        break
                    f.write(chunk)
                    advance(len(chunk))
        except BaseException:  # Ctrl-C before the first bytes: leave no empty .part behind
            if part.is_file() and part.stat().st_size == 0:
                part.unlink()
            raise
    got = part.stat().st_size
    if total is not None and got < total:
        raise ConnectionError(f"connection closed after {got:,} of {total:,} bytes")


def _content_range_start(header: str) -> int | None:
    # "bytes 100-999/1000"
    try:
        return int(header.split()[1].split("-")[0])
    except (IndexError, ValueError):
        return None


# -- verifying ----------------------------------------------------------------------------------


def file_md5(path: Path) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def verify(path: Path, a: Archive) -> None:
    """Size and MD5 when known, else the zip's own CRCs; a bad file is deleted."""
    size = path.stat().st_size
    problem = None
    if a.size is not None and size != a.size:
        problem = f"{size:,} bytes instead of {a.size:,}"
    elif a.md5 is not None:
        log.info("%s: checking the MD5 ...", a.name)
        digest = file_md5(path)
        if digest != a.md5.lower():
            problem = f"MD5 {digest} instead of {a.md5}"
    else:
        log.info("%s: no published checksum; checking the zip's CRCs ...", a.name)
        problem = _zip_problem(path)
    if problem:
        path.unlink()
        raise DownloadError(
            f"{a.name} is corrupt ({problem}); deleted it: run the same command "
            "again to download it afresh"
        )


def _zip_problem(path: Path) -> str | None:
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        return f"not a readable zip: {e}"
    return f"member {bad} fails its CRC check" if bad else None


# -- unpacking ----------------------------------------------------------------------------------


def unpack(archive: Path, a: Archive, root: Path) -> Path:
    """Unpack into a staging folder, mark it complete, then rename it to ``root/target``."""
    staging = root / f".{a.target}.unpacking"
    if staging.exists():  # left by an interrupted run: never reused
        shutil.rmtree(staging)
    staging.mkdir()
    try:
        with zipfile.ZipFile(archive) as z:
            members = [m for m in z.infolist() if _wanted(m.filename, a.keep)]
            if not members:
                raise DownloadError(f"{a.name} holds none of the expected files ({a.keep})")
            for m in members:
                _check_member_name(m.filename, a.name)
                _extract_member(z, m, staging)
        content = _single_top_folder(staging)
        (content / MARKER).write_text(
            json.dumps(
                {
                    "archive": a.name,
                    "size": archive.stat().st_size,
                    "md5": a.md5,
                    "files": sum(1 for m in members if not m.is_dir()),
                }
            )
        )
        os.replace(content, root / a.target)
    except zipfile.BadZipFile as e:
        raise DownloadError(f"{archive} cannot be unpacked ({e}): delete it and run again") from e
    except OSError as e:
        if e.errno not in NO_SPACE:
            raise
        shutil.rmtree(staging, ignore_errors=True)  # so that the free space reported is real
        left = int(archive.stat().st_size * UNPACKED_FACTOR)
        raise _no_space(e, root, f"unpacking {archive} (kept)", a, left) from None
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    log.info("%s: unpacked into %s", a.name, root / a.target)
    return root / a.target


def _wanted(name: str, keep: tuple[str, ...] | None) -> bool:
    return keep is None or any(fnmatch.fnmatch(name, pat) for pat in keep)


def _check_member_name(name: str, archive: str) -> None:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or "\\" in name:
        raise DownloadError(f"{archive}: refusing the unsafe member name {name!r}")


def _extract_member(z: zipfile.ZipFile, member: zipfile.ZipInfo, dest: Path) -> None:
    z.extract(member, dest)


def _single_top_folder(staging: Path) -> Path:
    """The archive's one top folder (``train2014/`` in train2014.zip), else ``staging`` itself
    (files at the top level)."""
    entries = list(staging.iterdir())
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return staging
