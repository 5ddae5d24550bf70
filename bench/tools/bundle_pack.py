"""An installed tree into a bundle: prune, then tar + xz (or zstd), cut into numbered parts."""
from __future__ import annotations

import csv
import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

from bench.tools.bundle_resolve import MIB, norm, run

ZIP_EPOCH = 315532800  # 1980-01-01, the earliest time a wheel (a zip) can give its files


def dist_records(site: Path):
    """(dist-info folder, [(relative path, size or None, hash or None)]) for each distribution."""
    for info in sorted(site.glob("*.dist-info")):
        rows = []
        with open(info / "RECORD", newline="") as f:
            for row in csv.reader(f):
                if row and not os.path.normpath(row[0]).startswith(".."):  # scripts land in bin/, outside
                    rows.append((row[0], int(row[2]) if len(row) > 2 and row[2] else None, row[1] or None))
        yield info, rows


def dist_name(info: Path) -> str:
    return norm(info.name.split("-")[0])


def tree_stats(root: Path) -> tuple[int, int]:
    sizes = [os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(root) for n in names]
    return len(sizes), sum(sizes)


def install(entries: list[dict], folder: Path, vpy: str, site: Path) -> list[str]:
    """pip installs the wheels into `site`; their console scripts are deleted, and their names returned.

    By name and hash from `folder` rather than by path, and without scripts, so that the tree does not
    depend on where the build ran: a path install writes the wheel's path into direct_url.json, and a
    script's shebang (and its hash in RECORD) names this build's venv. The bundle is imported from
    PYTHONPATH; its scripts never run."""
    reqs = site.parent / "install.txt"
    reqs.write_text("".join(f"{e['name']}=={e['version']} --hash=sha256:{e['sha256']}\n" for e in entries))
    run([sys.executable, "-m", "pip", "--python", vpy, "install", "--no-deps", "--no-index", "--find-links", folder,
         "--require-hashes", "--no-compile", "--quiet", "--target", site, "-r", reqs])
    scripts = site / "bin"
    if not scripts.is_dir():
        return []
    dropped = sorted(p.name for p in scripts.iterdir())
    shutil.rmtree(scripts)
    for record in site.glob("*.dist-info/RECORD"):  # pip records --target's bin/ as ../../bin/
        rows = record.read_text().splitlines(True)
        kept = [r for r in rows if not re.match(r"(\.\./)+bin/", r)]
        if kept != rows:
            record.write_text("".join(kept))
    return dropped


def prune(site: Path, patterns: dict[str, list[str]]) -> list[dict]:
    """Deletes the files of each distribution's RECORD that match its patterns (fnmatch: * spans folders).

    A pattern that matches nothing is an error: the prune list was written for other wheels.
    """
    records = {dist_name(info): (info, rows) for info, rows in dist_records(site)}
    pruned = []
    for dist, globs in patterns.items():
        if dist not in records:
            raise SystemExit(f"the prune list names {dist}, which is not installed (carried: {sorted(records)})")
        info, rows = records[dist]
        for pattern in globs:
            hits = [rel for rel, _, _ in rows if fnmatch.fnmatchcase(rel, pattern) and os.path.lexists(site / rel)]
            if not hits:
                raise SystemExit(f"prune pattern {dist}:{pattern} matches no file of {info.name}")
            for rel in hits:
                pruned.append({"path": rel, "bytes": os.lstat(site / rel).st_size, "dist": info.name})
                os.remove(site / rel)
    return sorted(pruned, key=lambda p: p["path"])


class PartWriter:
    """Cuts one byte stream into numbered files of at most `limit` bytes, each in its own folder."""

    def __init__(self, out: Path, stem: str, limit: int):
        self.out, self.stem, self.limit, self.parts, self.f = out, stem, limit, [], None

    def _open(self):
        i = len(self.parts)
        folder = self.out / f"part{i:02d}"
        folder.mkdir(parents=True)
        self.parts.append({"folder": folder.name, "file": f"{self.stem}.{i:02d}", "bytes": 0})
        self.f, self.h = open(folder / self.parts[-1]["file"], "wb"), hashlib.sha256()

    def write(self, data: bytes):
        view = memoryview(data)
        while view:
            if self.f is None or self.parts[-1]["bytes"] == self.limit:
                self.close()
                self._open()
            take = view[: self.limit - self.parts[-1]["bytes"]]
            self.f.write(take)
            self.h.update(take)
            self.parts[-1]["bytes"] += len(take)
            view = view[len(take):]
        return len(data)

    def close(self):
        if self.f:
            self.f.close()
            self.parts[-1]["sha256"] = self.h.hexdigest()
            self.f = None


def compressor(codec: str, level: int) -> list[str] | None:
    """The CLI that packs, or None for the stdlib's lzma (one core, but no tool needed)."""
    if codec == "zstd":
        if not shutil.which("zstd"):
            raise SystemExit("the zstd CLI is missing: apt-get install zstd, or use --codec xz")
        # --long=27 stays within every decoder's default window
        return ["zstd", "-q", "-c", "-T0", f"-{level}", "--long=27"]
    return ["xz", "-q", "-c", "-T0", f"-{level}"] if shutil.which("xz") else None


def normalized(t: tarfile.TarInfo) -> tarfile.TarInfo:
    """Owner and time out of the archive: the same wheels pack to the same bytes, whoever installs them when.

    A float mtime would also cost each file a PAX header of its own."""
    t.uid = t.gid = 0
    t.uname = t.gname = ""
    t.mtime = ZIP_EPOCH
    return t


def pack(site: Path, writer: PartWriter, codec: str, level: int):
    def add_tree(sink):
        with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for dirpath, dirs, names in os.walk(site):
                dirs.sort()
                for n in sorted(names):  # sorted, like the mtimes: the same tree packs to the same bytes
                    full = os.path.join(dirpath, n)
                    tar.add(full, os.path.relpath(full, site), recursive=False, filter=normalized)
    cmd = compressor(codec, level)
    if cmd is None:
        import lzma
        with lzma.LZMAFile(writer, "w", preset=level) as sink:
            add_tree(sink)
    else:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        reader = threading.Thread(target=lambda: shutil.copyfileobj(proc.stdout, writer, MIB))
        reader.start()
        add_tree(proc.stdin)
        proc.stdin.close()
        reader.join()
        if proc.wait():
            raise SystemExit(f"{cmd[0]} failed ({proc.returncode})")
    writer.close()
