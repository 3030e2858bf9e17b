"""srupp.data.fetch: HTTP download with resume and retries, and archive checks, offline.

A small HTTP server on 127.0.0.1 (port 0, background thread) serves files built
here; its handler supports Range requests and can be told to drop a connection
halfway or to ignore Range. test_download.py and test_iwslt.py use it too.
"""

import dataclasses
import io
import socket
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from srupp.data import fetch


def one_line(excinfo):
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


# ----------------------------------------------------------------------------- test server


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # keep test output quiet
        pass

    def do_GET(self):
        srv = self.server
        srv.requests.append({"path": self.path, "range": self.headers.get("Range")})
        body = srv.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start = 0
        rng = self.headers.get("Range")
        if rng and not srv.ignore_range:
            assert rng.startswith("bytes=") and rng.endswith("-"), rng
            start = int(rng[len("bytes="):-1])
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        payload = body[start:]
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if srv.drop_next:  # send half the bytes, then close the connection
            srv.drop_next -= 1
            self.wfile.write(payload[:len(payload) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(payload)


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.files, srv.requests, srv.drop_next, srv.ignore_range = {}, [], 0, False
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    t = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    t.join(5)


@pytest.fixture(autouse=True)
def no_retry_wait(monkeypatch):
    monkeypatch.setattr(fetch, "RETRY_WAIT_S", 0.0)


def make_zip(members, compression=zipfile.ZIP_STORED):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


@dataclasses.dataclass
class Layout:
    """An archive layout as fetch reads it (DatasetSpec is one)."""
    members: tuple
    sizes: dict
    is_tar: bool = False


DATA = bytes(range(256)) * 4  # 1,024 bytes
LAYOUT = Layout(("data.bin",), {"data.bin": len(DATA)})


# ----------------------------------------------------------------------------- download


def test_download_in_one_request(server, tmp_path):
    server.files["/f.zip"] = body = make_zip({"data.bin": DATA})
    dest = tmp_path / "cache" / "f.zip"  # its folder is created
    assert fetch.download(server.url + "/f.zip", dest, progress=False) == dest
    assert dest.read_bytes() == body and not dest.with_name("f.zip.part").exists()
    assert [r["range"] for r in server.requests] == [None]


def test_resume_after_dropped_connection(server, tmp_path):
    server.files["/f.zip"] = body = make_zip({"data.bin": DATA})
    dest, url = tmp_path / "f.zip", server.url + "/f.zip"
    part = tmp_path / "f.zip.part"
    server.drop_next = 1
    with pytest.raises(ValueError) as e:
        fetch.download(url, dest, retries=0, progress=False)
    msg = one_line(e)
    assert "interrupted" in msg and url in msg and str(part) in msg and "resume" in msg
    have = part.stat().st_size
    assert 0 < have < len(body) and not dest.exists()

    fetch.download(url, dest, retries=0, progress=False)
    assert server.requests[1]["range"] == f"bytes={have}-"
    assert dest.read_bytes() == body and not part.exists()


def test_interruption_is_retried_automatically(server, tmp_path):
    server.files["/f.zip"] = body = make_zip({"data.bin": DATA})
    server.drop_next = 1
    dest = fetch.download(server.url + "/f.zip", tmp_path / "f.zip", progress=False)
    assert [r["range"] is not None for r in server.requests] == [False, True]
    assert dest.read_bytes() == body


def test_server_ignoring_range_restarts_from_zero(server, tmp_path):
    server.files["/f.zip"] = body = make_zip({"data.bin": DATA})
    server.ignore_range = True
    stale = b"garbage that must not stay in front"
    (tmp_path / "f.zip.part").write_bytes(stale)
    dest = fetch.download(server.url + "/f.zip", tmp_path / "f.zip", progress=False)
    assert server.requests[0]["range"] == f"bytes={len(stale)}-"
    assert dest.read_bytes() == body


def test_stale_part_longer_than_file_starts_over(server, tmp_path):
    server.files["/f.zip"] = body = make_zip({"data.bin": DATA})
    (tmp_path / "f.zip.part").write_bytes(b"x" * (len(body) + 10))  # server answers 416
    dest = fetch.download(server.url + "/f.zip", tmp_path / "f.zip", progress=False)
    assert dest.read_bytes() == body
    assert [r["range"] is not None for r in server.requests] == [True, False]


def test_http_error_names_url_and_where_to_put_the_file(server, tmp_path):
    with pytest.raises(ValueError) as e:
        fetch.download(server.url + "/missing.zip", tmp_path / "f.zip", progress=False)
    msg = one_line(e)
    assert "HTTP 404" in msg and server.url + "/missing.zip" in msg
    assert str(tmp_path / "f.zip") in msg


def test_no_server_names_url_and_where_to_put_the_file(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: connection refused
    url = f"http://127.0.0.1:{port}/f.zip"
    with pytest.raises(ValueError) as e:
        fetch.download(url, tmp_path / "f.zip", progress=False)
    msg = one_line(e)
    assert url in msg and str(tmp_path / "f.zip") in msg and "no network" in msg


def test_a_folder_that_cannot_be_made_says_so(tmp_path):
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError) as e:
        fetch.download("http://127.0.0.1:9/unused", tmp_path / "a_file" / "f.zip",
                       progress=False)
    assert "cannot create" in one_line(e) and "SRUPP_CACHE" in one_line(e)


# ----------------------------------------------------------------------------- verification


def test_a_good_archive_is_stamped_and_then_trusted(tmp_path, monkeypatch):
    path = tmp_path / "f.zip"
    path.write_bytes(make_zip({"data.bin": DATA}))
    fetch.verify_archive(path, LAYOUT)
    stamp = tmp_path / "f.zip.verified"
    assert stamp.exists()

    def must_not_run(*args):
        raise AssertionError("checked again despite its stamp")

    monkeypatch.setattr(fetch, "_archive_problem", must_not_run)
    fetch.verify_archive(path, LAYOUT)  # unchanged: the stamp spares the check
    path.write_bytes(make_zip({"data.bin": DATA, "more": b"x"}))  # changed: checked again
    with pytest.raises(AssertionError, match="despite its stamp"):
        fetch.verify_archive(path, LAYOUT)


def test_bad_crc_deletes_archive(tmp_path):
    good = make_zip({"data.bin": DATA})
    i = good.index(DATA) + 10  # stored member: flip one of its data bytes
    path = tmp_path / "f.zip"
    path.write_bytes(good[:i] + bytes([good[i] ^ 0xFF]) + good[i + 1:])
    with pytest.raises(ValueError) as e:
        fetch.verify_archive(path, LAYOUT)
    msg = one_line(e)
    crc = zipfile.ZipFile(io.BytesIO(good)).getinfo("data.bin").CRC
    assert str(path) in msg and "CRC" in msg and f"expected 0x{crc:08x}" in msg
    assert "found 0x" in msg and "deleted" in msg
    assert not path.exists() and not (tmp_path / "f.zip.verified").exists()


def test_size_mismatch_deletes_archive(tmp_path):
    path = tmp_path / "f.zip"
    path.write_bytes(make_zip({"data.bin": DATA}))
    with pytest.raises(ValueError) as e:
        fetch.verify_archive(path, Layout(LAYOUT.members, {"data.bin": 999}))
    msg = one_line(e)
    assert str(path) in msg and "999 bytes" in msg and "1,024 bytes" in msg
    assert not path.exists()


def test_not_a_zip_and_missing_member(tmp_path):
    path = tmp_path / "f.zip"
    path.write_bytes(b"<html>not found</html>")
    with pytest.raises(ValueError, match="not a valid zip"):
        fetch.verify_archive(path, LAYOUT)
    path.write_bytes(make_zip({"other": b"x"}))
    with pytest.raises(ValueError, match="'data.bin' is missing"):
        fetch.verify_archive(path, LAYOUT)
    assert not path.exists()


def test_a_bad_archive_given_by_hand_is_kept(tmp_path):
    path = tmp_path / "f.zip"
    path.write_bytes(b"<html>not found</html>")
    with pytest.raises(ValueError) as e:
        fetch.verify_archive(path, LAYOUT, delete_bad=False)
    assert "not changed" in one_line(e) and path.exists()


def test_read_members_in_order_and_sized(tmp_path):
    path = tmp_path / "f.zip"
    path.write_bytes(make_zip({"b": b"second", "a": DATA}))
    assert fetch.read_members(path, Layout(("a", "b"), {"a": len(DATA)})) == [DATA, b"second"]
    with pytest.raises(ValueError) as e:
        fetch.read_members(path, Layout(("a",), {"a": 5}))
    assert "should be 5 bytes" in one_line(e) and str(path) in one_line(e)
