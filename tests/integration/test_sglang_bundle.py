"""The SGLang bundle's CPU dry run: bench/tools/sglang_bundle.py builds a small bundle from wheels made here.

The same code as the real sglang 0.5.17 build (stub dist-infos for the machine's packages, pip's
resolver, the lock, the allowlist, download by URL and hash, install, prune, pack, split, the
one-call plan) runs offline against a find-links folder of tiny wheels, with 64 KiB parts so that
there are several; ``unpack`` reassembles and checks them, with the pruned files skipped exactly.
The bundle is built under the repository's git-ignored ``.bundle/`` so that ``plan`` can carry it.
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
import uuid
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOISE = random.Random(0).randbytes(300_000)  # incompressible, so that 64 KiB parts make several
UNUSED = random.Random(1).randbytes(50_000)  # what the prune list deletes


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes], requires=(), scripts=()) -> Path:
    info = f"{name}-{version}.dist-info"
    files = dict(files)
    if scripts:
        files[f"{info}/entry_points.txt"] = ("[console_scripts]\n" + "".join(f"{s}\n" for s in scripts)).encode()
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
    # both ship top-level build_backend.py, as flashinfer-python and torch_c_dlpack_ext do
    make_wheel(folder, "tinyapp", "1.0", {"tinyapp/__init__.py": b"VERSION = '1.0'\n", "build_backend.py": b"a = 1\n"},
               requires=["tinylib>=1.0", "heldpkg>=1", "tinyleft", "tinyextra; python_version < '3'"],
               scripts=["tinyapp = tinyapp:main"])  # its shebang would name the build's venv: dropped
    make_wheel(folder, "tinylib", "1.0", {"tinylib/__init__.py": b"", "tinylib/blob.bin": NOISE,
                                          "tinylib/unused_ops.so": UNUSED, "build_backend.py": b"b = 22\n"})
    make_wheel(folder, "tinylib", "0.5", {"tinylib/__init__.py": b""})
    make_wheel(folder, "heldpkg", "1.0", {"heldpkg/__init__.py": b""})
    make_wheel(folder, "tinyleft", "1.0", {"tinyleft/__init__.py": b"never imported\n"})  # resolved, not allowed
    return folder


def bundle(*args):
    proc = subprocess.run([sys.executable, "-m", "bench.tools.sglang_bundle", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    print(proc.stdout[-3000:], proc.stderr[-2000:])
    return proc


def build_args(index: Path, out: Path, cache: Path, lock: Path, held=("heldpkg==1.0", "tinylib==0.5")):
    codec = "zstd" if shutil.which("zstd") else "xz"  # test_unpack_refuses_... packs with xz
    return ["build", "--packages", "tinyapp==1.0", "--find-links", index, "--no-index", "--python", sys.executable,
            "--held", *held, "--allow", "tinyapp", "tinylib", "--prune", "tinylib:tinylib/unused_*",
            "--codec", codec, "--level", "3", "--part-size", "64K", "--out", out, "--cache", cache, "--lock", lock]


@pytest.fixture(scope="module")
def built(index, tmp_path_factory):
    """The small bundle, under the repository (plan carries only paths there), removed afterwards."""
    tmp = tmp_path_factory.mktemp("built")
    out = REPO / ".bundle" / f"test-{uuid.uuid4().hex[:8]}"
    resolving_index = tmp / "index"  # a copy that goes away, so that the lock's URLs point nowhere later
    shutil.copytree(index, resolving_index)
    try:
        proc = bundle(*build_args(resolving_index, out, tmp / "cache", tmp / "lock.json"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        root = out / "tinyapp-1.0"
        yield {"root": root, "manifest": json.loads((root / "meta" / "manifest.json").read_text()),
               "lock": tmp / "lock.json", "cache": tmp / "cache", "stdout": proc.stdout, "tmp": tmp}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def test_allowlist_leaves_out_and_records_what_is_resolved_but_not_allowed(built, index):
    manifest, cache = built["manifest"], built["cache"]
    # heldpkg is on the "machine" in a usable version: not carried; tinylib 0.5 is not: replaced
    assert sorted(w["name"] for w in manifest["wheels"]) == ["tinyapp", "tinylib"]
    left = index / "tinyleft-1.0-py3-none-any.whl"
    assert manifest["left_out"] == [{"name": "tinyleft", "version": "1.0", "bytes": left.stat().st_size}]
    assert not list(cache.glob("tinyleft-*"))  # left out: never downloaded
    assert manifest["allow"] == ["tinyapp", "tinylib"]
    assert manifest["replaced"] == [{"name": "tinylib", "machine": "0.5", "carried": "1.0"}]
    assert manifest["held_required"] == {"heldpkg": ["heldpkg>=1 (tinyapp)"]}  # tinylib is carried now
    assert manifest["held"]["heldpkg"] == "1.0" and "tinylib" not in manifest["held"]
    for w in manifest["wheels"]:
        path = cache / w["file"]
        assert path.stat().st_size == w["bytes"] and hashlib.sha256(path.read_bytes()).hexdigest() == w["sha256"]
    # the lock holds the whole resolution, left-out wheels included, so that the allowlist needs no re-resolve
    lock = json.loads(built["lock"].read_text())
    assert [w["name"] for w in lock["wheels"]] == ["tinyapp", "tinyleft", "tinylib"]
    assert all(w["url"].startswith("file:") and len(w["sha256"]) == 64 and w["bytes"] > 0 for w in lock["wheels"])
    assert manifest["lock"]["sha256"] == hashlib.sha256(built["lock"].read_bytes()).hexdigest()


def test_pruned_files_are_recorded_absent_and_skipped_by_unpack(built, tmp_path):
    root, manifest = built["root"], built["manifest"]
    assert manifest["pruned"] == [{"path": "tinylib/unused_ops.so", "bytes": len(UNUSED),
                                   "dist": "tinylib-1.0.dist-info"}]
    assert manifest["prune"] == {"tinylib": [{"glob": "tinylib/unused_*", "why": "given on the command line"}]}
    assert manifest["scripts_dropped"] == ["tinyapp"]
    shared = {"build_backend.py": ["tinyapp-1.0.dist-info", "tinylib-1.0.dist-info"]}  # the last install's copy kept
    assert manifest["install"]["shared_paths"] == shared
    parts = manifest["parts"]
    assert len(parts) >= 4 and all(p["bytes"] == 64 * 1024 for p in parts[:-1]) and parts[-1]["bytes"] <= 64 * 1024
    for p in parts:
        assert hashlib.sha256((root / p["folder"] / p["file"]).read_bytes()).hexdigest() == p["sha256"]
    assert not (root / "work").exists()  # the install folder is removed after packing

    # everything moved into one flat folder unpacks too, every RECORD hash checked except the pruned file's
    flat = tmp_path / "flat"
    flat.mkdir()
    for p in parts:
        shutil.copy(root / p["folder"] / p["file"], flat)
    shutil.copy(root / "meta" / "manifest.json", flat)
    dest = tmp_path / "site"
    done = bundle("unpack", "--parts", flat, "--dest", dest, "--verify-hashes")
    assert done.returncode == 0 and "OK:" in done.stdout and "1 files pruned at build absent" in done.stdout
    assert (dest / "tinylib" / "blob.bin").read_bytes() == NOISE
    assert not (dest / "tinylib" / "unused_ops.so").exists()
    assert (dest / "tinyapp" / "__init__.py").exists() and not (dest / "heldpkg").exists()
    assert not (dest / "tinyleft").exists() and not (dest / "bin").exists()
    assert sum(len(fs) for _, _, fs in os.walk(dest)) == manifest["install"]["files"]

    # a manifest that does not list the pruned file: RECORD's file is missing, not pruned
    unlisted = dict(manifest, pruned=[])
    (flat / "manifest.json").write_text(json.dumps(unlisted))
    bad = bundle("unpack", "--parts", flat, "--dest", tmp_path / "site2")
    assert bad.returncode != 0 and "tinylib/unused_ops.so missing (not pruned)" in bad.stderr
    # a manifest that calls a shipped file pruned: present although pruned
    claimed = dict(manifest, pruned=manifest["pruned"] + [{"path": "tinylib/blob.bin", "bytes": len(NOISE),
                                                           "dist": "tinylib-1.0.dist-info"}])
    (flat / "manifest.json").write_text(json.dumps(claimed))
    bad = bundle("unpack", "--parts", flat, "--dest", tmp_path / "site3")
    assert bad.returncode != 0 and "tinylib/blob.bin is present, but the manifest lists it as pruned" in bad.stderr


def test_unpack_refuses_a_corrupt_or_missing_part_before_writing(built, tmp_path):
    root = tmp_path / "bundle"
    shutil.copytree(built["root"], root)
    victim = built["manifest"]["parts"][2]
    path = root / victim["folder"] / victim["file"]
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    refused = bundle("unpack", "--parts", root, "--dest", tmp_path / "site")
    assert refused.returncode != 0
    assert f"part {victim['folder']} ({victim['file']}) is corrupt" in refused.stderr
    assert not (tmp_path / "site").exists()  # refused before anything was written
    path.unlink()
    missing = bundle("unpack", "--parts", root, "--dest", tmp_path / "site")
    assert missing.returncode != 0 and f"part {victim['folder']}" in missing.stderr and "missing" in missing.stderr


def test_a_build_from_the_lock_runs_no_resolver_and_fetches_the_same_wheels(built, index, tmp_path):
    assert "install --dry-run" in built["stdout"] and "wrote the lock" in built["stdout"]
    out, cache = tmp_path / "out", tmp_path / "cache"
    # the index the lock was resolved against is gone: its file URLs are fetched by name and hash instead
    shutil.rmtree(built["tmp"] / "index")
    again = bundle(*build_args(index, out, cache, built["lock"]))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "install --dry-run" not in again.stdout and "from the lock" in again.stdout
    assert [f.name for f in cache.glob("requirements-*")] == ["requirements-by-name.txt"]
    manifest = json.loads((out / "tinyapp-1.0" / "meta" / "manifest.json").read_text())
    assert manifest["wheels"] == built["manifest"]["wheels"] and manifest["left_out"] == built["manifest"]["left_out"]
    assert manifest["pruned"] == built["manifest"]["pruned"] and "resolve" not in manifest["seconds"]
    # the same bytes, to the part's sha256, though the venv (in scripts) and the cache (in a path install) moved
    assert manifest["parts"] == built["manifest"]["parts"]
    assert "outside the repository" in again.stdout  # built under tmp: no plan

    # other inputs than the lock's are refused by name, before any download
    changed = bundle(*build_args(index, tmp_path / "out2", tmp_path / "cache2", built["lock"], held=["heldpkg==2.0"]))
    assert changed.returncode != 0 and "resolved for other inputs (differs in: held)" in changed.stderr
    assert "--resolve" in changed.stderr and not (tmp_path / "cache2").exists()


def test_plan_is_one_call_that_carries_the_parts_and_meta_and_runs_gpu_run(built):
    root, manifest = built["root"], built["manifest"]
    rel = os.path.relpath(root, REPO)
    carry = [f"{rel}/{p['folder']}" for p in manifest["parts"]] + [f"{rel}/meta"]
    carry += [".whl"] if (REPO / ".whl").is_dir() else []  # bench/gpu/wheels.sh's wheels travel too
    plan = bundle("plan", root)
    assert plan.returncode == 0, plan.stderr
    lines = plan.stdout.splitlines()
    assert lines[0].startswith("One device call for tinyapp-1.0: ") and "the limit is 64 MiB" in lines[0]
    assert lines[1:4] == [f"  carry: {json.dumps(carry)}",
                          f"  command: python3 -m bench.gpu.run --bundle {rel} --budget-s 540 --out $OUT",
                          "  timeout_s: 600"]
    assert (root / "plan.txt").read_text() == plan.stdout[:-1]  # print adds the last newline
    assert "\n".join(lines[1:4]) in built["stdout"]  # build printed the same call

    # a bundle too big for one call is refused, with the sizes
    pad = root / "part00" / "pad"
    with open(pad, "wb") as f:
        f.truncate(64 << 20)  # sparse: costs no disk
    try:
        over = bundle("plan", root)
    finally:
        pad.unlink()
    assert over.returncode != 0 and "does not fit one device call" in over.stderr
    assert "the limit is 64 MiB" in over.stderr


def test_unpack_refuses_a_tree_that_does_not_match_its_records(tmp_path, index):
    out, wheels = tmp_path / "out", tmp_path / "wheels"
    wheels.mkdir()
    shutil.copy(index / "tinyapp-1.0-py3-none-any.whl", wheels)
    built = bundle("build", "--from-wheels", wheels, "--python", sys.executable, "--codec", "xz", "--level", "1",
                   "--out", out)
    assert built.returncode == 0, built.stderr[-3000:]
    root = out / "wheels"
    manifest = json.loads((root / "meta" / "manifest.json").read_text())
    assert len(manifest["parts"]) == 1 and manifest["pruned"] == [] and manifest["lock"] is None
    # a manifest that claims one more file than the archive holds must fail the tree check
    manifest["install"]["files"] += 1
    (root / "meta" / "manifest.json").write_text(json.dumps(manifest))
    bad = bundle("unpack", "--parts", root, "--dest", tmp_path / "site")
    assert bad.returncode != 0 and "does not match" in bad.stderr
