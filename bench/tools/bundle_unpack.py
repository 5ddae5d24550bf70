"""A bundle back into a tree, checked: the parts' sha256 before anything is written, then the tree against
the manifest and every wheel's RECORD (less the files pruned at build), then the machine's held packages."""
from __future__ import annotations

import atexit
import base64
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from pathlib import Path

from bench.tools.bundle_pack import dist_records, tree_stats
from bench.tools.bundle_resolve import MIB, file_hash, sha256


def locate(parts_dir: Path, folder: str, name: str) -> Path | None:
    """A bundle file as moved into one folder or as built here (in its part or meta folder)."""
    return next((p for p in (parts_dir / name, parts_dir / folder / name) if p.is_file()), None)


class Concat:
    """The parts read back as one stream."""

    def __init__(self, paths):
        self.paths, self.f = list(paths), None

    def read(self, n=-1):  # a short read only at a part's end: tarfile and the decoders accept that
        while self.paths or self.f:
            if self.f is None:
                self.f = open(self.paths.pop(0), "rb")
            data = self.f.read(n if n and n > 0 else -1)
            if data:
                return data
            self.f.close()
            self.f = None
        return b""


def zstd_reader(stream, parts_dir: Path, manifest: dict, decoder: str):
    """A decompressed stream, from the CLI, the zstandard module or the carried zstandard wheel."""
    if decoder in ("auto", "cli") and shutil.which("zstd"):
        proc = subprocess.Popen(["zstd", "-d", "-q", "-c", "--long=27"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)

        def feed():
            shutil.copyfileobj(stream, proc.stdin, MIB)
            proc.stdin.close()
        threading.Thread(target=feed, daemon=True).start()
        return proc.stdout, proc
    if decoder == "cli":
        raise SystemExit("no zstd CLI here")
    try:
        import zstandard
    except ImportError:
        wheel = manifest.get("decoder_wheel") and locate(parts_dir, "meta", manifest["decoder_wheel"])
        if not wheel:
            raise SystemExit("cannot decompress: no zstd CLI, no zstandard module, no carried zstandard wheel "
                             "(build with --codec xz, which the stdlib decodes)")
        tmp = tempfile.mkdtemp(prefix="zstandard-")
        atexit.register(shutil.rmtree, tmp, True)
        zipfile.ZipFile(wheel).extractall(tmp)  # a C extension does not import from a zip
        sys.path.insert(0, tmp)
        import zstandard
    return zstandard.ZstdDecompressor(max_window_size=1 << 27).stream_reader(stream), None


def record_problems(dest: Path, manifest: dict, verify_hashes: bool) -> list[str]:
    """Every RECORD file present with its size (and hash), except the pruned ones, which must be absent."""
    pruned = {p["path"] for p in manifest.get("pruned", [])}
    shared = manifest["install"].get("shared_paths", {})
    problems = []
    for info, rows in dist_records(dest):
        for rel, nbytes, digest in rows:
            path = dest / rel
            if rel in pruned:
                if os.path.lexists(path):
                    problems.append(f"{info.name}: {rel} is present, but the manifest lists it as pruned")
            elif not os.path.lexists(path):
                problems.append(f"{info.name}: {rel} missing (not pruned)")
            elif rel in shared:
                continue
            elif nbytes is not None and path.stat().st_size != nbytes:
                problems.append(f"{info.name}: {rel} has {path.stat().st_size} bytes, RECORD says {nbytes}")
            elif verify_hashes and digest:
                algo, _, b64 = digest.partition("=")
                got = base64.urlsafe_b64encode(file_hash(path, algo).digest()).rstrip(b"=").decode()
                if got != b64:
                    problems.append(f"{info.name}: {rel} hash differs from RECORD")
    return problems


def unpack(a):
    parts_dir = Path(a.parts)
    manifest_path = locate(parts_dir, "meta", "manifest.json")
    if manifest_path is None:
        raise SystemExit(f"no manifest.json in {parts_dir} or {parts_dir}/meta")
    manifest = json.loads(manifest_path.read_text())
    paths = []
    for p in manifest["parts"]:  # every part checked before anything is written
        path = locate(parts_dir, p["folder"], p["file"])
        if path is None:
            raise SystemExit(f"part {p['folder']} ({p['file']}) is missing under {parts_dir}")
        if path.stat().st_size != p["bytes"] or sha256(path) != p["sha256"]:
            raise SystemExit(f"part {p['folder']} ({p['file']}) is corrupt: sha256 or size differs from the manifest")
        paths.append(path)
    print(f"{len(paths)} parts verified ({sum(p['bytes'] for p in manifest['parts']) / 1e6:.1f} MB)")
    t = time.time()
    dest = Path(a.dest)
    dest.mkdir(parents=True, exist_ok=True)
    stream, proc = Concat(paths), None
    if manifest["codec"] == "zstd":
        stream, proc = zstd_reader(stream, parts_dir, manifest, a.decoder)
        mode = "r|"
    else:
        mode = "r|xz"
    with tarfile.open(fileobj=stream, mode=mode) as tar:
        tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    if proc and proc.wait():
        raise SystemExit(f"zstd -d failed ({proc.returncode})")
    files, size = tree_stats(dest)
    want = manifest["install"]
    problems = [] if (files, size) == (want["files"], want["bytes"]) else [
        f"tree: {files} files, {size} bytes; the manifest says {want['files']}, {want['bytes']}"]
    problems += record_problems(dest, manifest, a.verify_hashes)
    if problems:
        raise SystemExit("extracted tree does not match:\n  " + "\n  ".join(problems[:20]))
    print(f"OK: {files} files, {size / 1e6:.1f} MB, {len(want['dists'])} distributions in {dest}, "
          f"{len(manifest.get('pruned', []))} files pruned at build absent "
          f"({time.time() - t:.1f} s to decompress, extract and check)")
    if a.check_held:
        check_held(manifest)


def check_held(manifest: dict):
    """Does this machine's copy of each held package meet what the bundle requires of it?"""
    from importlib import metadata
    try:
        from packaging.requirements import Requirement
    except ImportError:
        Requirement = None
    bad = 0
    for name, reqs in sorted(manifest.get("held_required", {}).items()):
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        for text in reqs:
            if have is None or (Requirement and not Requirement(text.rsplit(" (", 1)[0]).specifier.contains(
                    have, prereleases=True)):
                print(f"HELD MISMATCH: {name} {have or '(not installed)'} does not satisfy {text}")
                bad += 1
    print(f"held packages checked: {len(manifest.get('held_required', {}))}, problems: {bad}"
          + ("" if Requirement else " (packaging missing: versions not compared)"))
