"""Getting models from a hub: the real download code against a fake hub on loopback.

The fake hub (a threaded `http.server`) speaks the parts of the Hugging Face protocol that
`huggingface_hub` uses: HEAD/GET on `/{repo}/resolve/{revision}/{path}` with
`X-Repo-Commit`, `ETag` (git blob sha1) for small files, and for LFS files a 302 to a CDN URL
with `X-Linked-Etag` (sha256) and `X-Linked-Size`; `Range` requests; `X-Error-Code` on 404s.
It serves the fixture model's files as a `Xenova`-style ONNX repo and a `Helsinki-NLP`-style
tokenizer repo, records every request, and can cut a transfer short or corrupt a file.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import io
import json
import re
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from engine.cli.models import add_models_parser, run_models
from engine.decoding.translator import Translator
from engine.errors import ModelLoadError
from engine.hub import download as hub_download
from engine.hub.catalog import load_catalog, parse_catalog
from engine.hub.download import pull, resolve_model
from engine.hub.errors import (
    CatalogError,
    ChecksumError,
    DiskFullError,
    MissingFileError,
    NetworkError,
    OfflineError,
    RepoAccessError,
    UnknownModelError,
)
from engine.hub.settings import HubSettings
from engine.model.config import OPTIONAL_TOKENIZER_FILES, TOKENIZER_FILES
from tests.conftest import FIXTURE_MODEL, model_copy, needs_fixture

ONNX_REPO = "Xenova/opus-mt-en-zh"
TOKENIZER_REPO = "Helsinki-NLP/opus-mt-en-zh"
SENTENCE = "I will meet Tom at three"
ENCODER = f"{ONNX_REPO}/onnx/encoder_model.onnx"
LFS_SUFFIXES = (".onnx", ".spm", ".bin")


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class Seen:
    method: str
    path: str
    range: str | None
    auth: str | None = None


@dataclass
class FakeHub:
    """Repos by id -> {path in repo: bytes} at main; fault injection by 'repo/path' label.
    `push` makes a new main commit and keeps the old one reachable by its hash."""

    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    commits: dict[str, str] = field(default_factory=dict)
    history: dict[str, dict[str, dict[str, bytes]]] = field(default_factory=dict)
    branches: dict[str, dict[str, str]] = field(default_factory=dict)  # e.g. refs/pr/1
    requests: list[Seen] = field(default_factory=list)
    cut_once: set[str] = field(default_factory=set)
    corrupt: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    server: ThreadingHTTPServer | None = None

    def add_repo(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos[repo] = files
        self.commits[repo] = hashlib.sha1(repo.encode(), usedforsecurity=False).hexdigest()
        self.history[repo] = {self.commits[repo]: files}

    def push(self, repo: str, changes: dict[str, bytes]) -> str:
        """A new commit on main with `changes` applied; returns its hash."""
        files = {**self.repos[repo], **changes}
        commit = hashlib.sha1(
            f"{repo}:{len(self.history[repo])}".encode(), usedforsecurity=False
        ).hexdigest()
        self.repos[repo], self.commits[repo] = files, commit
        self.history[repo][commit] = files
        return commit

    def branch(self, repo: str, name: str, changes: dict[str, bytes]) -> str:
        """A commit on top of main that main does not have (like a pull request's)."""
        main = self.commits[repo]
        commit = self.push(repo, changes)
        self.repos[repo], self.commits[repo] = self.history[repo][main], main
        self.branches.setdefault(repo, {})[name] = commit
        return commit

    def snapshot(self, repo: str, revision: str) -> tuple[str, dict[str, bytes]] | None:
        """(commit, files) of a revision: main, a branch or a commit hash."""
        revision = urllib.parse.unquote(revision)
        commit = self.commits[repo] if revision == "main" else revision
        commit = self.branches.get(repo, {}).get(revision, commit)
        files = self.history[repo].get(commit)
        return None if files is None else (commit, files)

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def gets(self, fragment: str = "") -> list[Seen]:
        with self.lock:
            return [r for r in self.requests if r.method == "GET" and fragment in r.path]

    def start(self) -> None:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self.handle_any(send_body=False)

            def do_GET(self) -> None:
                self.handle_any(send_body=True)

            def handle_any(self, send_body: bool) -> None:
                with hub.lock:
                    seen = Seen(
                        self.command,
                        self.path,
                        self.headers.get("Range"),
                        self.headers.get("Authorization"),
                    )
                    hub.requests.append(seen)
                if self.path.startswith("/cdn/"):
                    self.serve_cdn(send_body)
                    return
                if self.path.startswith("/api/models/"):
                    self.serve_tree()
                    return
                match = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", self.path)
                if match is None:
                    self.error(404, "RepoNotFound", None)
                    return
                repo, revision, path = match.groups()
                if repo not in hub.repos:
                    self.error(404, "RepoNotFound", None)
                    return
                found = hub.snapshot(repo, revision)
                if found is None:
                    self.error(404, "RevisionNotFound", None)
                    return
                commit, files = found
                if path not in files:
                    self.error(404, "EntryNotFound", commit)
                    return
                data = files[path]
                if path.endswith(LFS_SUFFIXES):
                    sha = hashlib.sha256(data).hexdigest()
                    self.send_response(302)
                    location = f"{hub.url}/cdn/{repo}/{commit}/{path}?sha={sha}"
                    self.send_header("Location", location)
                    self.send_header("X-Repo-Commit", commit)
                    self.send_header("X-Linked-Etag", f'"{sha}"')
                    self.send_header("X-Linked-Size", str(len(data)))
                    self.send_header("ETag", f'W/"{git_sha1(sha.encode())}"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_file(f"{repo}/{path}", data, commit, git_sha1(data), send_body)

            def serve_tree(self) -> None:
                """GET /api/models/OWNER/NAME/tree/REVISION?recursive=True: every file."""
                url = urllib.parse.urlsplit(self.path)
                match = re.match(r"^/api/models/([^/]+/[^/]+)/tree/([^/]+)$", url.path)
                if match is None or match.group(1) not in hub.repos:
                    self.error(404, "RepoNotFound", None)
                    return
                found = hub.snapshot(match.group(1), match.group(2))
                if found is None:
                    self.error(404, "RevisionNotFound", None)
                    return
                commit, files = found
                entries = [
                    {"type": "file", "path": path, "size": len(data), "oid": git_sha1(data)}
                    for path, data in sorted(files.items())
                ]
                body = json.dumps(entries).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def serve_cdn(self, send_body: bool) -> None:
                parts = self.path[len("/cdn/") :].split("?")[0].split("/")
                repo_id, commit, path = "/".join(parts[:2]), parts[2], "/".join(parts[3:])
                data = hub.history.get(repo_id, {}).get(commit, {}).get(path)
                if data is None:
                    self.error(404, None, None)
                    return
                label = f"{repo_id}/{path}"
                self.send_file(label, data, commit, hashlib.sha256(data).hexdigest(), send_body)

            def send_file(
                self, label: str, data: bytes, commit: str, etag: str, send_body: bool
            ) -> None:
                if label in hub.corrupt:
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                start = 0
                wanted = self.headers.get("Range")
                if wanted:
                    start = int(re.match(r"bytes=(\d+)-", wanted).group(1))  # type: ignore[union-attr]
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                self.send_header("X-Repo-Commit", commit)
                self.send_header("ETag", f'"{etag}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if not send_body:
                    return
                body = data[start:]
                with hub.lock:
                    cut = label in hub.cut_once
                    hub.cut_once.discard(label)
                if cut:
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def error(self, status: int, code: str | None, commit: str | None) -> None:
                body = json.dumps({"error": code or "not found"}).encode()
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                if commit:
                    self.send_header("X-Repo-Commit", commit)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


def fixture_repos() -> dict[str, dict[str, bytes]]:
    """The fixture's files laid out like the real ONNX and tokenizer repos."""
    onnx = {
        f"onnx/{name}": (FIXTURE_MODEL / name).read_bytes()
        for name in (
            "encoder_model.onnx",
            "decoder_model_merged.onnx",
            "encoder_model_quantized.onnx",
            "decoder_model_merged_quantized.onnx",
        )
    }
    onnx["config.json"] = (FIXTURE_MODEL / "config.json").read_bytes()
    tokenizer = {"README.md": b"fake Helsinki-NLP repo\n"}
    for name in (*TOKENIZER_FILES, *OPTIONAL_TOKENIZER_FILES):
        if (FIXTURE_MODEL / name).is_file():
            tokenizer[name] = (FIXTURE_MODEL / name).read_bytes()
    return {ONNX_REPO: onnx, TOKENIZER_REPO: tokenizer}


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A running fake hub, with HF_ENDPOINT and all caches pointed at it / tmp_path."""
    needs_fixture()
    import huggingface_hub.constants
    from huggingface_hub.utils import reset_sessions

    server = FakeHub()
    for repo, files in fixture_repos().items():
        server.add_repo(repo, files)
    server.start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("NMT_INCREMENTAL_HOME", str(tmp_path / "nmt"))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("NMT_INCREMENTAL_CATALOG", raising=False)
    # huggingface_hub froze HF_HUB_OFFLINE (set by CI) into its HTTP sessions at import.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    reset_sessions()
    yield server
    server.stop()
    reset_sessions()


def en_zh_pull(**kwargs: object) -> hub_download.PullResult:
    return pull(load_catalog().lookup("en-zh"), log=lambda _: None, **kwargs)  # type: ignore[arg-type]


def fixture_translation() -> str:
    return Translator.from_dir(FIXTURE_MODEL).translate([SENTENCE])[0].text


def run_cli(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="nmt-incremental")
    add_models_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = run_models(args)
    return status, out.getvalue(), err.getvalue()


# -- pulling ----------------------------------------------------------------------------


def test_pull_gives_a_directory_the_engine_loads(hub: FakeHub, tmp_path: Path) -> None:
    result = en_zh_pull()
    model_dir = result.model_dir
    assert model_dir == tmp_path / "nmt" / "models" / "en-zh"
    assert Translator.from_dir(model_dir).translate([SENTENCE])[0].text == fixture_translation()
    # Files are links into the Hugging Face cache, the target-language token comes from the
    # catalog (the fake repos do not carry nmt-incremental.json), commits are recorded.
    encoder = model_dir / "onnx" / "encoder_model.onnx"
    assert encoder.is_symlink()
    assert (tmp_path / "hf" / "hub") in encoder.resolve().parents
    project = json.loads((model_dir / "nmt-incremental.json").read_text())
    assert project["source_prefix"] == ">>cmn_Hans<<"
    assert project["sources"]["onnx"]["commit"] == hub.commits[ONNX_REPO]
    assert project["sources"]["tokenizer"]["commit"] == hub.commits[TOKENIZER_REPO]
    assert sorted(result.downloaded) == sorted(
        [
            f"{ONNX_REPO}/onnx/encoder_model.onnx",
            f"{ONNX_REPO}/onnx/decoder_model_merged.onnx",
            *(
                f"{TOKENIZER_REPO}/{name}"
                for name in hub.repos[TOKENIZER_REPO]
                if name != "README.md"
            ),
        ]
    )
    assert set(result.verified) >= set(result.downloaded)
    # Only the fp32 variant was asked for.
    assert not (model_dir / "onnx" / "encoder_model_quantized.onnx").exists()


def test_pull_cli_prints_the_directory_and_quantized_adds_int8(hub: FakeHub) -> None:
    status, out, err = run_cli("models", "pull", "en-zh")
    assert status == 0, err
    model_dir = Path(out.strip().splitlines()[-1])
    assert "downloaded" in err
    status, out, err = run_cli("models", "pull", "en-zh", "--quantized")
    assert status == 0, err
    assert Path(out.strip().splitlines()[-1]) == model_dir
    both = [Translator.from_dir(model_dir, quantized=q) for q in (False, True)]
    assert all(t.translate([SENTENCE])[0].text for t in both)
    assert len(hub.gets("encoder_model_quantized.onnx")) == 1


def test_second_pull_and_resolve_make_no_request(hub: FakeHub, tmp_path: Path) -> None:
    first = en_zh_pull()
    hub.requests.clear()
    second = en_zh_pull()
    assert second.from_cache and second.model_dir == first.model_dir
    assert resolve_model("en-zh", log=lambda _: None) == first.model_dir
    assert resolve_model(ONNX_REPO, log=lambda _: None) == first.model_dir  # by repo id
    # The model directory is rebuilt from the hub cache alone, e.g. after copying a cache.
    for path in sorted((tmp_path / "nmt").rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
    assert resolve_model("en-zh", log=lambda _: None) == first.model_dir
    assert Translator.from_dir(first.model_dir).translate([SENTENCE])[0].text
    assert hub.requests == []


def test_refresh_asks_the_hub_but_downloads_nothing_new(hub: FakeHub) -> None:
    en_zh_pull()
    hub.requests.clear()
    result = en_zh_pull(refresh=True)
    assert result.from_cache
    assert hub.requests and hub.gets() == []


def test_token_from_the_environment_is_sent(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    en_zh_pull()
    assert hub.requests
    assert {r.auth for r in hub.requests} == {"Bearer hf_test_token"}


def test_offline_with_warm_cache_works(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = en_zh_pull().model_dir
    hub.requests.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert en_zh_pull().model_dir == model_dir
    assert resolve_model("en-zh", log=lambda _: None) == model_dir
    translator = Translator.from_dir(resolve_model("en-zh", log=lambda _: None))
    assert translator.translate([SENTENCE])[0].text == fixture_translation()
    # int8 was never pulled: offline, that is a clear error rather than a download.
    with pytest.raises(OfflineError, match=r"encoder_model_quantized\.onnx"):
        resolve_model("en-zh", quantized=True, log=lambda _: None)
    assert hub.requests == []


def test_offline_with_cold_cache_fails_clearly(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OfflineError) as caught:
        en_zh_pull()
    message = str(caught.value)
    for needed in ("HF_HUB_OFFLINE", "HF_ENDPOINT", "models pull en-zh", "copy"):
        assert needed in message
    status, _, err = run_cli("models", "pull", "en-zh")
    first, *rest = err.splitlines()
    assert status == 2 and first.startswith("error: en-zh is not in the cache, and HF_HUB_OFF")
    # Short lines, the first saying what is wrong (it was one line of 420 characters).
    cache = str(HubSettings.from_env().hub_cache)
    assert cache in err and len(rest) >= 3, err
    assert all(len(line.replace(cache, "")) <= 100 for line in err.splitlines()), err
    assert not any("error" in line for line in rest), err
    assert hub.requests == []


def test_unreachable_hub_fails_fast_with_advice(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    with pytest.raises(NetworkError) as caught:
        en_zh_pull()
    assert "cannot reach" in str(caught.value)
    assert "HF_ENDPOINT" in str(caught.value) and "HF_HUB_OFFLINE=1" in str(caught.value)


def test_missing_file_names_repo_and_file_before_downloading(hub: FakeHub) -> None:
    del hub.repos[ONNX_REPO]["onnx/decoder_model_merged.onnx"]
    with pytest.raises(MissingFileError) as caught:
        en_zh_pull()
    assert ONNX_REPO in str(caught.value)
    assert "onnx/decoder_model_merged.onnx" in str(caught.value)
    assert hub.gets() == []  # every file is checked with a HEAD before any download


def test_optional_file_may_be_absent(hub: FakeHub) -> None:
    hub.repos[TOKENIZER_REPO].pop("generation_config.json", None)
    model_dir = en_zh_pull().model_dir
    assert not (model_dir / "generation_config.json").exists()
    assert Translator.from_dir(model_dir).translate([SENTENCE])[0].text
    hub.requests.clear()
    en_zh_pull()  # the cache remembers the file does not exist: still no request
    assert hub.requests == []


def test_interrupted_download_resumes_on_next_call(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # huggingface_hub writes what it receives in 10 MB chunks and drops a chunk cut short;
    # the fixture's files are smaller than that, so read in smaller chunks here.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    hub.cut_once.add(ENCODER)
    with pytest.raises(NetworkError, match="again to resume"):
        en_zh_pull()
    partial = list((tmp_path / "hf" / "hub").rglob("*.incomplete"))
    assert len(partial) == 1 and partial[0].stat().st_size > 0
    kept = partial[0].stat().st_size
    result = en_zh_pull()
    resumed = [r for r in hub.gets("encoder_model.onnx") if r.range]
    assert [r.range for r in resumed] == [f"bytes={kept}-"]
    encoder = result.model_dir / "onnx" / "encoder_model.onnx"
    assert encoder.read_bytes() == (FIXTURE_MODEL / "encoder_model.onnx").read_bytes()
    assert Translator.from_dir(result.model_dir).translate([SENTENCE])[0].text


def test_checksum_mismatch_is_detected_and_not_kept(hub: FakeHub, tmp_path: Path) -> None:
    hub.corrupt.add(ENCODER)
    with pytest.raises(ChecksumError) as caught:
        en_zh_pull()
    error = caught.value
    assert (error.repo, error.path) == (ONNX_REPO, "onnx/encoder_model.onnx")
    expected = hashlib.sha256((FIXTURE_MODEL / "encoder_model.onnx").read_bytes()).hexdigest()
    assert error.expected == expected and error.actual != expected
    blobs = tmp_path / "hf" / "hub" / "models--Xenova--opus-mt-en-zh" / "blobs"
    assert not (blobs / expected).exists()
    hub.corrupt.clear()
    assert Translator.from_dir(en_zh_pull().model_dir).translate([SENTENCE])[0].text


def test_corrupt_cache_file_is_reported_by_verify(hub: FakeHub) -> None:
    model_dir = en_zh_pull().model_dir
    status, out, _ = run_cli("models", "verify", str(model_dir))
    assert status == 0, out
    assert fixture_translation() in out and "checksum ok" in out
    blob = (model_dir / "source.spm").resolve()
    blob.chmod(0o644)
    data = blob.read_bytes()
    blob.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    status, out, _ = run_cli("models", "verify", "en-zh")
    assert status == 1 and "CORRUPT source.spm" in out
    with pytest.raises(ChecksumError):
        en_zh_pull()  # pull checks the cache too, and drops the bad copy...
    assert en_zh_pull().model_dir == model_dir  # ...so that the next pull fetches it again


def test_verify_lists_the_files_it_loads_and_checks_the_cache_against_no_cache() -> None:
    needs_fixture()
    status, out, _ = run_cli("models", "verify", str(FIXTURE_MODEL))
    assert status == 0, out
    fp32 = out[out.index("fp32: loads; decoder split") : out.index("int8: loads")]
    assert "decoder_model.onnx" in fp32 and "decoder_with_past_model.onnx" in fp32
    assert "decoder_model_merged.onnx" not in out  # present, but not what split loads
    assert out.count("with and without the KV cache: the same tokens on 3/3 sentences") == 2
    assert "int8 vs fp32: the same tokens on" in out and out.rstrip().endswith("ok")


def test_verify_finds_a_with_past_decoder_that_disagrees(tmp_path: Path) -> None:
    """A decoder-with-past whose weights differ from the first-step decoder's (a bad
    export, a mixed-up download) loads fine; only comparing with uncached decoding shows it."""
    onnx = pytest.importorskip("onnx")
    needs_fixture()
    names = ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")
    model_dir = model_copy(tmp_path / "model", {n: FIXTURE_MODEL / n for n in names})
    step = onnx.load(str(model_dir / "decoder_with_past_model.onnx"))
    for init in step.graph.initializer:
        if init.name == "final_logits_bias":  # steps after the first now favour token 7
            bias = onnx.numpy_helper.to_array(init).copy()
            bias[0, 7] += 100.0
            init.CopyFrom(onnx.numpy_helper.from_array(bias, init.name))
    onnx.save(step, str(model_dir / "decoder_with_past_model.onnx"))
    status, out, _ = run_cli("models", "verify", str(model_dir))
    assert status == 1, out
    assert "PROBLEM: they must agree" in out and "1 problem(s)" in out


def test_a_pinned_revision_is_what_gets_downloaded(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Upstream edits a file after the catalog pinned a commit (as the Helsinki repos did
    to generation_config.json): pulls keep getting the pinned files; `--revision` /
    `--tokenizer-revision` choose another, and nmt-incremental.json records the commit."""
    pinned = hub.commits[TOKENIZER_REPO]
    old = hub.repos[TOKENIZER_REPO]["generation_config.json"]
    new = old.replace(b'"num_beams": 4', b'"num_beams": 6')
    assert new != old
    newer = hub.push(TOKENIZER_REPO, {"generation_config.json": new})
    catalog = json.loads(Path(load_catalog().source).read_text(encoding="utf-8"))
    catalog["models"]["en-zh"]["tokenizer"]["revision"] = pinned
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps(catalog), encoding="utf-8")
    monkeypatch.setenv("NMT_INCREMENTAL_CATALOG", str(path))

    model_dir = en_zh_pull().model_dir
    assert (model_dir / "generation_config.json").read_bytes() == old
    sources = json.loads((model_dir / "nmt-incremental.json").read_text())["sources"]
    assert sources["tokenizer"] == {"repo": TOKENIZER_REPO, "revision": pinned, "commit": pinned}

    status, out, err = run_cli("models", "pull", "en-zh", "--tokenizer-revision", "main")
    assert out.strip() == str(model_dir)
    assert status == 0, err
    assert (model_dir / "generation_config.json").read_bytes() == new
    sources = json.loads((model_dir / "nmt-incremental.json").read_text())["sources"]
    assert sources["tokenizer"]["commit"] == newer

    status, _, err = run_cli("models", "pull", "en-zh", "--revision", "0" * 40)
    assert status == 2 and f"{ONNX_REPO}" in err and "has no revision" in err, err


def test_disk_full(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(hub_download, "_free_bytes", lambda path: 1000)
        with pytest.raises(DiskFullError, match="HF_HUB_CACHE"):
            en_zh_pull()
    assert hub.gets() == []

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    import huggingface_hub.file_download

    monkeypatch.setattr(huggingface_hub.file_download, "http_get", no_space)
    with pytest.raises(DiskFullError, match="no space left"):
        en_zh_pull()


# -- names, catalog, listing ------------------------------------------------------------


def test_unknown_pair_lists_the_known_ones(hub: FakeHub) -> None:
    with pytest.raises(UnknownModelError) as caught:
        resolve_model("xx-yy")
    assert "en-zh" in str(caught.value) and "zh-en" in str(caught.value)
    status, _, err = run_cli("models", "pull", "xx-yy")
    assert status == 2 and "unknown model 'xx-yy'" in err and "en-zh" in err
    assert hub.requests == []  # a name that is no repo id never reaches the hub
    # A repo id the catalog does not know is looked for on the hub.
    with pytest.raises(RepoAccessError, match="repository Someone/opus-mt-xx-yy not found"):
        resolve_model("Someone/opus-mt-xx-yy")


def test_directories_resolve_as_themselves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "en-zh").mkdir()  # an existing directory wins over a catalog name
    assert resolve_model("en-zh") == Path("en-zh")
    with pytest.raises(ModelLoadError, match="not a model directory"):
        resolve_model("./no/such/model")


def test_list_shows_catalog_and_cache(hub: FakeHub) -> None:
    status, out, _ = run_cli("models", "list")
    assert status == 0
    assert re.search(
        r"^en-zh\s+en->zh\s+Xenova/opus-mt-en-zh\s+Helsinki-NLP/opus-mt-en-zh\s+-$", out, re.M
    )
    en_zh_pull(quantized=True)
    status, out, _ = run_cli("models", "list")
    line = next(row for row in out.splitlines() if row.startswith("en-zh"))
    assert "int8" in line and "fp32" not in line and re.search(r"\d+(\.\d)? [KM]B", line)
    assert re.search(r"^zh-en\s.*\s-$", out, re.M)


def test_catalog() -> None:
    catalog = load_catalog()
    en_zh = catalog.lookup("en-zh")
    assert en_zh.source_prefix == ">>cmn_Hans<<"
    assert (en_zh.onnx.repo, en_zh.onnx.subfolder) == (ONNX_REPO, "onnx")
    assert en_zh.tokenizer.repo == TOKENIZER_REPO
    assert catalog.lookup("HELSINKI-NLP/opus-mt-zh-en").name == "zh-en"
    assert catalog.lookup("zh-en").source_prefix == ""
    with pytest.raises(CatalogError, match=r"models\.bad\.onnx\.repo"):
        parse_catalog(
            {"models": {"bad": {"source_lang": "en", "target_lang": "zh", "onnx": {"repo": "x"}}}}
        )


def test_settings_are_read_at_call_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.example/")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    settings = HubSettings.from_env()
    assert settings.endpoint == "http://mirror.example"
    assert settings.hub_cache == tmp_path / "home" / "hub"
    assert settings.offline
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    settings = HubSettings.from_env()
    assert settings.hub_cache == tmp_path / "elsewhere" and not settings.offline
