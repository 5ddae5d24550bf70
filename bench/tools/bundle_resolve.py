"""What a bundle carries: pip's resolver over stub dist-infos, the lock file, and the download.

The lock records the whole resolution (every wheel pip chose that the machine lacks, with its URL,
sha256, size and its requirements, extras followed), so that a build from it needs no resolver and
what is carried can still be narrowed by an allowlist afterwards.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import unquote, urlparse

MIB = 1 << 20
LOCK_VERSION = 1


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.lower())


def req_name(text: str) -> str:
    """The distribution a requirement string ('numba==0.65.1') names."""
    return norm(re.match(r"[A-Za-z0-9._-]+", text).group(0))


def file_hash(path: Path, algo: str = "sha256"):
    h = hashlib.new(algo)
    with open(path, "rb") as f:  # in blocks: some of sgl_kernel's libraries are hundreds of MB
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h


def sha256(path: Path) -> str:
    return file_hash(path).hexdigest()


def run(cmd):
    print("+", " ".join(map(str, cmd))[:300], flush=True)
    proc = subprocess.run([str(c) for c in cmd], stderr=subprocess.PIPE, text=True)
    # this machine's pip config names local indexes that lack most packages: one warning per package
    sys.stderr.write("".join(l for l in proc.stderr.splitlines(True) if not l.startswith("WARNING: Location 'file:")))
    if proc.returncode:
        raise SystemExit(f"{cmd[0]} ... {cmd[3:6]} failed ({proc.returncode})")


def find_python(explicit: str | None) -> str:
    """A Python 3.12 here, so that pip evaluates markers and wheel tags as the GPU machine will."""
    if explicit:
        return explicit
    pyenv = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))
    found = [shutil.which("python3.12"), *pyenv]
    for py in filter(None, found):
        if subprocess.run([py, "-c", "pass"], capture_output=True).returncode == 0:  # pyenv shims may refuse
            return py
    print("warning: no Python 3.12 here; resolving for", sys.version.split()[0], file=sys.stderr)
    return sys.executable


def make_venv(python: str, venv: Path, stubs: dict[str, str]) -> str:
    run([python, "-m", "venv", "--without-pip", venv])
    vpy = str(venv / "bin" / "python")
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(subprocess.check_output([vpy, "-c", code], text=True).strip())
    for name, version in stubs.items():  # name + version only: pip then never looks past them
        d = site / f"{name.replace('-', '_')}-{version}.dist-info"
        d.mkdir(parents=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (d / "INSTALLER").write_text("stub\n")
        (d / "RECORD").write_text("")
    return vpy


def evaluated_requirements(report: dict) -> dict[str, list[str]]:
    """Each resolved distribution's requirements that apply here ('numba==0.65.1'), extras followed."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip carries its own copy
        from pip._vendor.packaging.requirements import Requirement
    env = report["environment"]
    metas = {norm(i["metadata"]["name"]): i["metadata"] for i in report["install"]}
    extras = {norm(i["metadata"]["name"]): set(i.get("requested_extras") or []) for i in report["install"]}
    out: dict[str, list[str]] = {}
    for final in (False, True):  # gather the extras asked for, then record (deeper extra chains: rare)
        for name, meta in metas.items():
            for text in meta.get("requires_dist") or []:
                req = Requirement(text)
                if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in {""} | extras[name]):
                    continue
                extras.setdefault(norm(req.name), set()).update(req.extras)
                if final:
                    out.setdefault(name, []).append(f"{req.name}{req.specifier}")
    return out


def url_bytes(url: str) -> int | None:
    """A wheel's size without downloading it: the file's, or the server's Content-Length."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        path = Path(unquote(parsed.path))
        return path.stat().st_size if path.exists() else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as resp:
            return int(resp.headers["Content-Length"])
    except (OSError, KeyError, ValueError):
        return None  # only the manifest's left-out sizes go without it


def resolve(inputs: dict, vpy: str, unversioned: set[str], pip_args: list[str], work: Path) -> dict:
    """The lock: the wheels pip picks on top of the stubbed machine, less those it has in unseen versions."""
    report_path = work / "report.json"
    run([sys.executable, "-m", "pip", "--python", vpy, "install", "--dry-run", "--only-binary=:all:", "--quiet",
         "--report", report_path, *pip_args, *inputs["packages"]])
    report = json.loads(report_path.read_text())
    requires = evaluated_requirements(report)
    items = [i for i in report["install"] if norm(i["metadata"]["name"]) not in unversioned]
    with ThreadPoolExecutor(8) as pool:
        sizes = list(pool.map(url_bytes, [i["download_info"]["url"] for i in items]))
    wheels = []
    for item, size in zip(items, sizes):
        url, name = item["download_info"]["url"], norm(item["metadata"]["name"])
        wheels.append({"name": name, "version": item["metadata"]["version"], "file": unquote(url.rsplit("/", 1)[-1]),
                       "url": url, "sha256": item["download_info"]["archive_info"]["hashes"]["sha256"],
                       "bytes": size, "requires": requires.get(name, [])})
    return {"lock_version": LOCK_VERSION, "inputs": inputs, "environment": report["environment"],
            "wheels": sorted(wheels, key=lambda w: w["name"])}


def read_lock(path: Path, inputs: dict) -> dict:
    lock = json.loads(path.read_text())
    if lock.get("lock_version") != LOCK_VERSION or lock["inputs"] != inputs:
        changed = [k for k in inputs if lock.get("inputs", {}).get(k) != inputs[k]]
        raise SystemExit(f"{path} was resolved for other inputs (differs in: {', '.join(changed) or 'lock_version'}): "
                         "rerun with --resolve to rewrite it")
    return lock


def missing_local(url: str) -> bool:
    return url.startswith("file:") and not Path(unquote(urlparse(url).path)).exists()


def download(wheels: list[dict], cache: Path, vpy: str, pip_args: list[str]) -> list[Path]:
    """The wheels by URL and sha256, kept in `cache` across builds."""
    cache.mkdir(parents=True, exist_ok=True)
    fetch = [w for w in wheels if not ((cache / w["file"]).exists() and sha256(cache / w["file"]) == w["sha256"])]
    # a local mirror's file on the machine that resolved is asked of the index by name and hash instead
    by_name = [f"{w['name']}=={w['version']} --hash=sha256:{w['sha256']}" for w in fetch if missing_local(w["url"])]
    by_url = [f"{w['url']}#sha256={w['sha256']}" for w in fetch if not missing_local(w["url"])]
    for kind, lines in (("url", by_url), ("name", by_name)):  # one --hash line puts pip in hash mode for all
        if lines:
            reqs = cache / f"requirements-by-{kind}.txt"
            reqs.write_text("\n".join(lines) + "\n")
            run([sys.executable, "-m", "pip", "--python", vpy, "download", "--no-deps", "--only-binary=:all:",
                 "--quiet", "-d", cache, "-r", reqs, *pip_args])
    for w in fetch:
        path = cache / w["file"]
        if not path.exists() or sha256(path) != w["sha256"]:
            raise SystemExit(f"{w['file']}: missing or its sha256 differs from the lock after download")
    return [cache / w["file"] for w in wheels]
