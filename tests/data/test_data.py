"""`sat data coco` against a local HTTP server (127.0.0.1) serving small COCO-shaped archives."""

from __future__ import annotations

import errno
import hashlib
import http.client
import io
import json
import shutil
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers.photos import encode
from PIL import Image

from showattendtell.cli.main import main
from showattendtell.data import download
from showattendtell.data.datasets import DatasetError, load_split


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def _coco_archives() -> dict[str, bytes]:
    """URL path -> archive bytes, laid out like the real COCO 2014 and Karpathy archives."""
    train = {1: "train2014", 2: "train2014", 3: "train2014"}
    val = {10: "val2014", 11: "val2014", 12: "val2014", 13: "val2014"}
    name = {i: f"COCO_{d}_{i:012d}.jpg" for i, d in {**train, **val}.items()}
    jpeg = {i: encode(Image.new("RGB", (32, 24), (i * 40 % 256, 90, 160))) for i in name}

    def captions(ids):
        return json.dumps(
            {
                "images": [{"id": i, "file_name": name[i], "width": 32, "height": 24} for i in ids],
                "annotations": [
                    {"id": 100 * i + k, "image_id": i, "caption": f"picture {i} take {k}"}
                    for i in ids
                    for k in range(5)
                ],
                "type": "captions",
                "info": {},
                "licenses": [],
            }
        ).encode()

    karpathy_split = {
        1: "train",
        2: "train",
        3: "restval",
        10: "restval",
        11: "val",
        12: "test",
        13: "test",
    }
    dataset_coco = json.dumps(
        {
            "dataset": "coco",
            "images": [
                {
                    "filepath": d,
                    "filename": name[i],
                    "cocoid": i,
                    "split": karpathy_split[i],
                    "sentences": [{"raw": f"picture {i} take {k}"} for k in range(5)],
                }
                for i, d in {**train, **val}.items()
            ],
        }
    ).encode()
    return {
        "annotations/annotations_trainval2014.zip": _zip(
            {
                "annotations/captions_train2014.json": captions(train),
                "annotations/captions_val2014.json": captions(val),
                "annotations/instances_train2014.json": b"{}",  # not unpacked: captions only
            }
        ),
        "people/karpathy/deepimagesent/caption_datasets.zip": _zip(
            {
                "dataset_coco.json": dataset_coco,
                "dataset_flickr8k.json": b"{}",
            }
        ),
        "zips/train2014.zip": _zip({f"train2014/{name[i]}": jpeg[i] for i in train}),
        "zips/val2014.zip": _zip({f"val2014/{name[i]}": jpeg[i] for i in val}),
    }


class _Handler(BaseHTTPRequestHandler):
    """Serves ``files`` with Range support; ``cut`` makes the next response stop after N bytes."""

    files: dict[str, bytes] = {}
    cut: dict[str, int] = {}
    requests: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path.lstrip("/")
        rng = self.headers.get("Range")
        self.requests.append((path, rng))
        data = self.files.get(path)
        if data is None:
            self.send_error(404)
            return
        start = int(rng.split("=")[1].split("-")[0]) if rng else 0
        if start >= len(data):
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.end_headers()
            return
        body = data[start:]
        self.send_response(206 if rng else 200)
        if rng:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        n = self.cut.pop(path, None)
        self.wfile.write(body if n is None else body[:n])
        if n is not None:
            self.wfile.flush()
            self.close_connection = True

    def log_message(self, *args) -> None:
        pass


@pytest.fixture()
def server():
    archives = _coco_archives()
    handler = type("Handler", (_Handler,), {"files": dict(archives), "cut": {}, "requests": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    handler.base = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield handler
    httpd.shutdown()
    httpd.server_close()


def _manifest(tmp_path: Path, files: dict[str, bytes], md5: bool = True) -> Path:
    m = {
        Path(p).name: {"size": len(d), "md5": hashlib.md5(d).hexdigest() if md5 else None}
        for p, d in files.items()
    }
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(m))
    return path


def _sat_data(server, root: Path, manifest: Path, *extra: str) -> int:
    return main(
        [
            "data",
            "coco",
            "--root",
            str(root),
            "--base-url",
            server.base,
            "--manifest",
            str(manifest),
            *extra,
        ]
    )


def test_downloads_verifies_unpacks_and_loads(server, tmp_path, capsys):
    root = tmp_path / "coco"
    assert _sat_data(server, root, _manifest(tmp_path, server.files)) == 0
    out = capsys.readouterr().out
    assert f"sat features --config configs/coco_soft.yaml --data.root {root}" in out
    assert f"sat train --config configs/coco_soft.yaml --data.root {root}" in out
    for target in ("annotations", "caption_datasets", "train2014", "val2014"):
        assert (root / target / download.MARKER).is_file()
    assert sorted(p.name for p in (root / "annotations").iterdir()) == [
        download.MARKER,
        "captions_train2014.json",
        "captions_val2014.json",
    ]
    assert not list((root / "downloads").iterdir())  # archives deleted after unpacking
    assert not list(root.glob(".*unpacking"))

    test = load_split("coco", root, "test")  # Karpathy's split from caption_datasets/
    assert sorted(im.coco_id for im in test.images) == [12, 13] and not test.missing
    assert len(load_split("coco", root, "train+restval").images) == 4

    n = len(server.requests)
    assert _sat_data(server, root, _manifest(tmp_path, server.files)) == 0
    assert len(server.requests) == n  # everything complete: nothing fetched again


def test_resumes_an_interrupted_transfer(server, tmp_path, capsys):
    root = tmp_path / "coco"
    path = "zips/val2014.zip"
    data = server.files[path]
    server.cut[path] = 700
    manifest = _manifest(tmp_path, {path: data})
    assert _sat_data(server, root, manifest, "--only", "val2014.zip", "--retries", "0") == 1
    err = capsys.readouterr().err
    assert "broke off at 700 bytes" in err and "run the same command again to resume" in err
    part = root / "downloads" / "val2014.zip.part"
    assert part.stat().st_size == 700
    assert not (root / "val2014").exists()

    assert _sat_data(server, root, manifest, "--only", "val2014.zip", "--keep-archives") == 0
    assert server.requests[-1] == (path, "bytes=700-")
    assert (root / "downloads" / "val2014.zip").read_bytes() == data
    assert len(list((root / "val2014").glob("*.jpg"))) == 4


def test_resumes_within_one_run(server, tmp_path):
    root = tmp_path / "coco"
    path = "zips/train2014.zip"
    server.cut[path] = 1000
    assert (
        _sat_data(
            server,
            root,
            _manifest(tmp_path, server.files),
            "--only",
            "train2014.zip",
            "--retries",
            "2",
        )
        == 0
    )
    assert [r for p, r in server.requests if p == path] == [None, "bytes=1000-"]
    assert len(list((root / "train2014").glob("*.jpg"))) == 3


@pytest.mark.parametrize("with_md5", [True, False])
def test_detects_a_corrupted_archive(server, tmp_path, capsys, with_md5):
    root = tmp_path / "coco"
    path = "zips/train2014.zip"
    good = server.files[path]
    manifest = _manifest(tmp_path, {path: good}, md5=with_md5)
    bad = bytearray(good)
    bad[good.index(b"JFIF") + 200] ^= 0xFF  # inside a JPEG member: same size, wrong content
    server.files[path] = bytes(bad)
    assert _sat_data(server, root, manifest, "--only", "train2014.zip") == 1
    err = capsys.readouterr().err
    assert "train2014.zip is corrupt" in err
    assert ("MD5" in err) if with_md5 else ("CRC" in err)
    assert not list((root / "downloads").iterdir())  # the bad file is gone, not reused
    assert not (root / "train2014").exists()

    server.files[path] = good
    assert _sat_data(server, root, manifest, "--only", "train2014.zip") == 0
    assert (root / "train2014" / download.MARKER).is_file()


def test_an_interrupted_unpack_never_looks_complete(server, tmp_path, monkeypatch):
    root = tmp_path / "coco"
    manifest = _manifest(tmp_path, server.files)
    real = download._extract_member
    calls = []

    def crash_on_second(z, member, dest):
        calls.append(member.filename)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the user pressing Ctrl-C mid-unpack
        real(z, member, dest)

    monkeypatch.setattr(download, "_extract_member", crash_on_second)
    assert _sat_data(server, root, manifest, "--only", "annotations_trainval2014.zip") == 130
    assert not (root / "annotations").exists()  # neither half there nor marked complete
    assert not list(root.glob(".*unpacking"))
    with pytest.raises(DatasetError, match="sat data coco"):
        load_split("coco", root, "val")

    monkeypatch.setattr(download, "_extract_member", real)
    n = len(server.requests)
    assert _sat_data(server, root, manifest, "--only", "annotations_trainval2014.zip") == 0
    assert len(server.requests) == n  # the verified archive was kept for the retry
    assert len(load_split("coco", root, "val").images) == 0  # captions there, images not


def test_refuses_a_folder_it_did_not_unpack(server, tmp_path, capsys):
    root = tmp_path / "coco"
    (root / "val2014").mkdir(parents=True)
    (root / "val2014" / "half.jpg").write_bytes(b"")
    assert _sat_data(server, root, _manifest(tmp_path, server.files), "--only", "val2014.zip") == 1
    assert "was not completely unpacked" in capsys.readouterr().err


def test_missing_file_on_server_is_a_clear_error(server, tmp_path, capsys):
    del server.files["zips/val2014.zip"]
    assert (
        _sat_data(
            server,
            tmp_path / "c",
            _manifest(tmp_path, {"val2014.zip": b"x"}),
            "--only",
            "val2014.zip",
        )
        == 1
    )
    assert "HTTP 404" in capsys.readouterr().err


def test_official_manifest_is_complete():
    names = {a.name: a for a in download.COCO_ARCHIVES}
    assert names["train2014.zip"].url() == "http://images.cocodataset.org/zips/train2014.zip"
    assert names["caption_datasets.zip"].url() == (
        "https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip"
    )
    assert names["val2014.zip"].size == 6_645_013_297
    assert all(a.md5 for a in download.COCO_ARCHIVES if a.name != "caption_datasets.zip")


def test_the_downloader_is_a_library_without_the_command(server, tmp_path):
    """Python code fetches a dataset through the data package, no argument parsing involved."""
    files = {p: d for p, d in server.files.items() if p.endswith("val2014.zip")}
    manifest = download.load_manifest(str(_manifest(tmp_path, files)))
    archives = download.select_archives(["val2014.zip"], manifest)
    download.fetch_all(archives, tmp_path / "coco", base_url=server.base)
    assert download.is_complete(tmp_path / "coco" / "val2014", archives[0])
    assert not (tmp_path / "coco" / "downloads" / "val2014.zip").exists()  # archives deleted


def _error_line(capsys) -> str:
    """The one ``error:`` line the CLI printed (no traceback)."""
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1/x", "http://"])
def test_a_base_url_that_is_not_http_is_a_usage_error(tmp_path, capsys, url):
    root = tmp_path / "coco"
    argv = ["data", "coco", "--root", str(root), "--base-url", url, "--only", "val2014.zip"]
    assert main(argv) == 2
    assert "must be an http(s) address" in _error_line(capsys)
    assert not root.exists()  # checked before anything is created or fetched


def test_a_root_that_is_a_file_is_a_usage_error(server, tmp_path, capsys):
    root = tmp_path / "coco"
    root.write_text("")
    assert _sat_data(server, root, _manifest(tmp_path, server.files), "--only", "val2014.zip") == 2
    assert "a file of that name is in the way" in _error_line(capsys)
    assert not server.requests


def test_a_root_in_a_read_only_folder_is_a_usage_error(server, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    real = Path.mkdir

    def mkdir(self, *args, **kwargs):  # chmod does not stop root (tests may run as root)
        if locked in (self, *self.parents):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    root = locked / "coco"
    assert _sat_data(server, root, _manifest(tmp_path, server.files), "--only", "val2014.zip") == 2
    assert "cannot create the folder for --root" in _error_line(capsys)
    assert not server.requests


def _full_disk(monkeypatch, free: int) -> None:
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=free))


@pytest.mark.parametrize("name", ["val2014.zip", "caption_datasets.zip"])
def test_a_full_disk_while_downloading_fails_at_once(server, tmp_path, capsys, monkeypatch, name):
    root = tmp_path / "coco"
    path = next(p for p in server.files if Path(p).name == name)
    manifest = _manifest(tmp_path, {path: server.files[path]})
    if name == "caption_datasets.zip":  # no published size
        manifest.write_text(json.dumps({name: {"size": None, "md5": None}}))
    calls = []

    def disk_fills_up(url, part, a):
        calls.append(url)
        part.write_bytes(b"x" * 100)
        raise OSError(errno.ENOSPC, "No space left on device")

    _full_disk(monkeypatch, 12_345_678)
    monkeypatch.setattr(download, "_transfer", disk_fills_up)
    monkeypatch.setattr(download.time, "sleep", lambda s: pytest.fail("retried on a full disk"))
    assert _sat_data(server, root, manifest, "--only", name) == 1
    assert len(calls) == 1  # no retries: they cannot help
    line = _error_line(capsys)
    assert "no space left on the device" in line and "12.3 MB free" in line
    assert "kept 100 bytes" in line and "0.0 GB" not in line
    assert ("needs about" in line) == (name == "val2014.zip")  # never a guessed size
    assert (root / "downloads" / f"{name}.part").stat().st_size == 100


def test_a_full_disk_while_unpacking_keeps_the_archive(server, tmp_path, capsys, monkeypatch):
    root = tmp_path / "coco"
    manifest = _manifest(tmp_path, server.files)
    real = download._extract_member

    def disk_full(z, member, dest):
        raise OSError(errno.ENOSPC, "No space left on device")

    _full_disk(monkeypatch, 2_500_000_000)
    monkeypatch.setattr(download, "_extract_member", disk_full)
    assert _sat_data(server, root, manifest, "--only", "val2014.zip") == 1
    line = _error_line(capsys)
    assert "no space left on the device while unpacking" in line and "2.5 GB free" in line
    assert (root / "downloads" / "val2014.zip").is_file()  # verified archive kept
    assert not list(root.glob(".*unpacking")) and not (root / "val2014").exists()

    monkeypatch.setattr(download, "_extract_member", real)
    n = len(server.requests)
    assert _sat_data(server, root, manifest, "--only", "val2014.zip") == 0
    assert len(server.requests) == n


def test_too_little_space_never_shows_zero_gb(server, tmp_path, capsys, monkeypatch):
    names = ("val2014.zip", "caption_datasets.zip")
    files = {p: d for p, d in server.files.items() if Path(p).name in names}
    manifest = _manifest(tmp_path, files)
    manifest.write_text(
        json.dumps({**json.loads(manifest.read_text()), "caption_datasets.zip": {"size": None}})
    )
    _full_disk(monkeypatch, 1000)
    only = ("--only", "val2014.zip", "caption_datasets.zip")
    assert _sat_data(server, tmp_path / "coco", manifest, *only) == 1
    line = _error_line(capsys)
    assert "has 1,000 bytes free" in line and "0.0 GB" not in line
    assert "plus the unknown size of caption_datasets.zip" in line
    assert not server.requests


@pytest.mark.parametrize(
    "entry",
    [{"size": "1389861"}, {"size": -1}, {"size": True}, {"md5": 123}, {"md5": "abc"}, {"sha": "x"}],
)
def test_a_malformed_manifest_entry_is_named(server, tmp_path, capsys, entry):
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"val2014.zip": entry}))
    assert _sat_data(server, tmp_path / "coco", manifest, "--only", "val2014.zip") == 2
    assert "the entry 'val2014.zip'" in _error_line(capsys)
    assert not server.requests


def test_ctrl_c_before_the_first_bytes_leaves_no_empty_part(server, tmp_path, monkeypatch):
    def interrupted(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(http.client.HTTPResponse, "read", interrupted)
    root = tmp_path / "coco"
    assert (
        _sat_data(server, root, _manifest(tmp_path, server.files), "--only", "val2014.zip") == 130
    )
    assert not list((root / "downloads").iterdir())
