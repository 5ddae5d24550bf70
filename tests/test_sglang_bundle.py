"""The SGLang bundle's CPU dry run: bench/sglang_bundle.py builds a small bundle from wheels made here.

The same code as the real sglang 0.5.17 build (stub dist-infos for the machine's packages, pip's
resolver, download by URL and hash, install, pack, split) runs offline against a find-links folder
of three tiny wheels, with 64 KiB parts so that there are several; then ``unpack`` reassembles and
checks them, and a corrupted part is refused by name.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes], requires=()) -> Path:
    info = f"{name}-{version}.dist-info"
    files = dict(files)
    files[f"{info}/METADATA"] = ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n%s" % (
        name, version, "".join(f"Requires-Dist: {r}\n" for r in requires))).encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items()) + f"{info}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name_, data in files.items():
            z.writestr(name_, data)
        z.writestr(f"{info}/RECORD", record)
    return path


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    folder = tmp_path_factory.mktemp("index")
    noise = random.Random(0).randbytes(300_000)  # incompressible, so that 64 KiB parts make several
    # both ship top-level build_backend.py, as flashinfer-python and torch_c_dlpack_ext do
    make_wheel(folder, "tinyapp", "1.0", {"tinyapp/__init__.py": b"VERSION = '1.0'\n", "build_backend.py": b"a = 1\n"},
               requires=["tinylib>=1.0", "heldpkg>=1", "tinyextra; python_version < '3'"])
    make_wheel(folder, "tinylib", "1.0", {"tinylib/__init__.py": b"", "tinylib/blob.bin": noise,
                                          "build_backend.py": b"b = 22\n"})
    make_wheel(folder, "tinylib", "0.5", {"tinylib/__init__.py": b""})
    make_wheel(folder, "heldpkg", "1.0", {"heldpkg/__init__.py": b""})
    return folder


def bundle(args, **kw):
    proc = subprocess.run([sys.executable, "-m", "bench.sglang_bundle", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, **kw)
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    return proc


def test_small_bundle_builds_splits_unpacks_and_refuses_a_corrupt_part(tmp_path, index):
    codec = "zstd" if shutil.which("zstd") else "xz"  # the other test packs with xz
    out, cache = tmp_path / "out", tmp_path / "cache"
    built = bundle(["build", "--packages", "tinyapp==1.0", "--find-links", str(index), "--no-index",
                    "--python", sys.executable, "--held", "heldpkg==1.0", "tinylib==0.5", "--codec", codec,
                    "--level", "3", "--part-size", "64K", "--out", str(out), "--cache", str(cache)])
    assert built.returncode == 0, built.stderr[-3000:]
    root = out / "tinyapp-1.0"
    manifest = json.loads((root / "meta" / "manifest.json").read_text())
    # heldpkg is on the "machine" in a usable version: not carried; tinylib 0.5 is not: replaced
    assert sorted(w["name"] for w in manifest["wheels"]) == ["tinyapp", "tinylib"]
    assert manifest["replaced"] == [{"name": "tinylib", "machine": "0.5", "carried": "1.0"}]
    assert manifest["held_required"] == {"heldpkg": ["heldpkg>=1 (tinyapp)"]}  # tinylib is carried now
    assert manifest["held"]["heldpkg"] == "1.0" and "tinylib" not in manifest["held"]
    for w in manifest["wheels"]:
        path = cache / w["file"]
        assert path.stat().st_size == w["bytes"] and hashlib.sha256(path.read_bytes()).hexdigest() == w["sha256"]
    shared = {"build_backend.py": ["tinyapp-1.0.dist-info", "tinylib-1.0.dist-info"]}  # the last install's copy kept
    assert manifest["install"]["shared_paths"] == shared
    parts = manifest["parts"]
    assert len(parts) >= 4 and all(p["bytes"] <= 64 * 1024 for p in parts)
    assert all(p["bytes"] == 64 * 1024 for p in parts[:-1])
    for p in parts:
        assert hashlib.sha256((root / p["folder"] / p["file"]).read_bytes()).hexdigest() == p["sha256"]
    plan = (root / "plan.txt").read_text()
    # tiny parts all fit in one device call; each is carried and moved aside, the last command unpacks
    assert plan.count("carry:") == 1 and "gpu_acceptance" in plan and "unpack --parts /tmp/bundle" in plan
    assert all(f"{p['folder']}/* /tmp/bundle/" in plan for p in parts) and "meta/* /tmp/bundle/" in plan
    assert not (root / "work").exists()  # the install folder is removed after packing
    print(f"{codec}: {len(parts)} parts, {sum(p['bytes'] for p in parts)} bytes packed from "
          f"{manifest['install']['bytes']} installed in {manifest['install']['files']} files")

    # as on the device: everything moved into one flat folder
    flat = tmp_path / "bundle"
    flat.mkdir()
    for p in parts:
        shutil.copy(root / p["folder"] / p["file"], flat)
    shutil.copy(root / "meta" / "manifest.json", flat)
    dest = tmp_path / "site"
    done = bundle(["unpack", "--parts", str(flat), "--dest", str(dest), "--verify-hashes"])
    assert done.returncode == 0 and "OK:" in done.stdout, done.stderr
    assert (dest / "tinylib" / "blob.bin").read_bytes() == random.Random(0).randbytes(300_000)
    assert (dest / "tinyapp" / "__init__.py").exists() and not (dest / "heldpkg").exists()
    dists = {d["dist"] for d in manifest["install"]["dists"]}
    assert dists == {"tinyapp-1.0.dist-info", "tinylib-1.0.dist-info"}
    files = sum(len(fs) for _, _, fs in os.walk(dest))
    assert files == manifest["install"]["files"]

    # the parts as built (in their folders) unpack too; a flipped byte in one is refused by name
    victim = parts[2]
    path = root / victim["folder"] / victim["file"]
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    refused = bundle(["unpack", "--parts", str(root), "--dest", str(tmp_path / "site2")])
    assert refused.returncode != 0
    assert f"part {victim['folder']} ({victim['file']}) is corrupt" in refused.stderr
    assert not (tmp_path / "site2").exists()  # refused before anything was written

    path.unlink()
    missing = bundle(["unpack", "--parts", str(root), "--dest", str(tmp_path / "site3")])
    assert missing.returncode != 0 and f"part {victim['folder']}" in missing.stderr and "missing" in missing.stderr


def test_unpack_refuses_a_tree_that_does_not_match_its_records(tmp_path, index):
    out, wheels = tmp_path / "out", tmp_path / "wheels"
    wheels.mkdir()
    shutil.copy(index / "tinyapp-1.0-py3-none-any.whl", wheels)
    built = bundle(["build", "--from-wheels", str(wheels), "--python", sys.executable, "--codec", "xz",
                    "--level", "1", "--part-size", "1M", "--out", str(out)])
    assert built.returncode == 0, built.stderr[-3000:]
    root = out / "wheels"
    manifest = json.loads((root / "meta" / "manifest.json").read_text())
    assert len(manifest["parts"]) == 1
    replanned = bundle(["plan", str(root)])
    assert replanned.returncode == 0 and "call 1/1" in replanned.stdout
    # a manifest that claims one more file than the archive holds must fail the tree check
    manifest["install"]["files"] += 1
    (root / "meta" / "manifest.json").write_text(json.dumps(manifest))
    bad = bundle(["unpack", "--parts", str(root), "--dest", str(tmp_path / "site")])
    assert bad.returncode != 0 and "does not match" in bad.stderr
