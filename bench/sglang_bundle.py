"""SGLang 0.5.17 for the GPU machine, as a bundle of parts that the device tool can carry.

The GPU machine has Python 3.12 with torch 2.11.0 (+cu130) and a long list of packages, but no
package index; sglang 0.5.17 is the newest release that pins that torch. Here, where pip reaches
the index, ``build`` resolves sglang for Python 3.12 on x86-64 Linux *on top of the machine's
packages*, downloads what the machine lacks (~1 GB of wheels), installs them into one folder, packs
it as tar + zstd and splits the archive into parts small enough for one device call each (the tool
carries at most 64 MiB of working tree a call)::

    python -m bench.sglang_bundle build                 # -> .bundle/sglang-0.5.17/ (git-ignored)
    python -m bench.sglang_bundle plan                  # the device calls again, for today's tree
    python -m bench.sglang_bundle unpack --parts DIR --dest /tmp/sglang-site [--check-held]

The machine's packages are modelled by stub ``.dist-info`` folders (name and version only) in a
Python 3.12 venv, so pip's own resolver keeps what is there and lists only what must come along,
including the machine packages whose versions sglang cannot use (numpy, tokenizers,
transformers): those are carried and shadow the machine's on PYTHONPATH. Packages the machine has
in an unknown version are dropped from the bundle; ``unpack --check-held`` then checks, there,
that the installed versions meet what the bundle requires of them.

Why zstd -10: on the 3.44 GB install, ``zstd -T0 -10 --long=27`` gave 699 MB (12 parts) in 1.5 to
8 min on this machine's 2 shared cores; -3 gave 802 MB (14 parts) in 41 s; -13 gave 706 MB in 25
min; -19 gave ~626 MB (11 parts) in ~17 min in an earlier measurement. A part costs a device call;
a minute of build here costs nothing there. ``--long=27`` stays within every decoder's default
window. Unpack needs no package: the ``zstd`` CLI, the ``zstandard`` module, or the zstandard wheel
carried beside the manifest (unzipped to a temp folder: a C extension does not import from a zip),
in that order. ``--codec xz`` packs for the stdlib's lzma alone (not measured on this tree).
``build --packages NAME==VER --find-links DIR --no-index`` or ``--from-wheels DIR`` make a small
bundle through the same code (the test suite does). The printed plan (also ``plan.txt``) lists the
device calls: the parts, packed into as few calls as the 64 MiB limit allows, each moved to
/tmp/bundle (the machine keeps /tmp between back-to-back calls of one hold, not the working tree);
the last call unpacks and runs the acceptance.
"""
from __future__ import annotations

import argparse
import atexit
import base64
import csv
import glob
import hashlib
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

REPO = Path(__file__).resolve().parents[1]
ROOT_SPEC = "sglang==0.5.17"
MIB = 1 << 20
CALL_LIMIT = 64 * MIB  # the device tool's working-tree limit per call, carried paths included

# The GPU machine's versions as sessions read them there (KINDS.md). These become stub dist-infos,
# so pip keeps them when they satisfy sglang and plans a replacement (carried) when they do not.
HELD_VERSIONS = {
    "torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0", "triton": "3.6.0",
    "numpy": "2.5.2", "tokenizers": "0.23.2", "transformers": "5.17.0", "safetensors": "0.8.0",
    "huggingface-hub": "1.33.0", "accelerate": "1.15.0", "sentencepiece": "0.2.2",
    "tiktoken": "0.14.0", "jax": "0.11.2", "jaxlib": "0.11.2", "onnx": "1.23.1",
    "onnxruntime": "1.30.0", "cupy-cuda13x": "14.2.0", "torchmetrics": "1.9.0",
}
# Also on the machine, versions not recorded: never carried, checked there by unpack --check-held.
HELD_NAMES = """absl-py aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
humanize hypothesis idna imageio iniconfig interface-meta jax-cuda13-pjrt jax-cuda13-plugin jaxtyping
jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx-ir onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu scikit-build-core
scikit-image scikit-learn scipy seaborn sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile timm torchdiffeq torch-geometric toolz tqdm treescope typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def file_hash(path: Path, algo: str = "sha256"):
    h = hashlib.new(algo)
    with open(path, "rb") as f:  # in blocks: some of sgl_kernel's libraries are hundreds of MB
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h


def sha256(path: Path) -> str:
    return file_hash(path).hexdigest()


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": MIB, "G": 1 << 30}
    text = text.upper().rstrip("IB")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


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


def held_requirements(report: dict, held: set[str]) -> dict[str, list[str]]:
    """What the resolved packages ask of each held one ('numba>=0.60 (sglang)'), extras followed."""
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
                target = norm(req.name)
                extras.setdefault(target, set()).update(req.extras)
                if final and target in held:
                    out.setdefault(target, []).append(f"{req.name}{req.specifier} ({meta['name']})")
    return out


def resolve(a, vpy: str, held: set[str], versions: dict[str, str], work: Path) -> tuple[list[dict], dict]:
    report_path = work / "report.json"
    run([sys.executable, "-m", "pip", "--python", vpy, "install", "--dry-run", "--only-binary=:all:", "--quiet",
         "--report", report_path, *a.pip_args, *a.packages])
    report = json.loads(report_path.read_text())
    carried, replaced, excluded = [], [], []
    for item in report["install"]:
        name, version = norm(item["metadata"]["name"]), item["metadata"]["version"]
        if name in a.exclude:
            excluded.append(f"{name}=={version}")
        elif name in held and name not in versions:
            continue  # on the machine in a version we cannot see: checked there, not carried
        else:
            if name in versions:  # pip replaces a stubbed version only when sglang cannot use it
                replaced.append({"name": name, "machine": versions[name], "carried": version})
            carried.append(item)
    held.difference_update(r["name"] for r in replaced)  # carried now: the machine's copy no longer matters
    info = {"held_required": held_requirements(report, held), "replaced": replaced, "excluded": excluded,
            "environment": report["environment"]}
    return carried, info


def download(items: list[dict], cache: Path, vpy: str, pip_args: list[str]) -> list[Path]:
    cache.mkdir(parents=True, exist_ok=True)
    wanted, missing = [], []
    for item in items:
        url, digest = item["download_info"]["url"], item["download_info"]["archive_info"]["hashes"]["sha256"]
        path = cache / url.rsplit("/", 1)[-1]
        if not (path.exists() and sha256(path) == digest):  # the cache survives reruns
            missing.append(f"{url}#sha256={digest}")
        wanted.append((path, digest))
    if missing:
        reqs = cache / "requirements.txt"
        reqs.write_text("\n".join(missing) + "\n")
        run([sys.executable, "-m", "pip", "--python", vpy, "download", "--no-deps", "--only-binary=:all:",
             "--quiet", "-d", cache, "-r", reqs, *pip_args])
    for path, digest in wanted:
        if sha256(path) != digest:
            raise SystemExit(f"{path.name}: sha256 differs from the resolver's report")
    return [p for p, _ in wanted]


def dist_records(site: Path):
    """(dist-info folder, [(relative path, size or None, hash or None)]) for each distribution."""
    for info in sorted(site.glob("*.dist-info")):
        rows = []
        with open(info / "RECORD", newline="") as f:
            for row in csv.reader(f):
                if row and not os.path.normpath(row[0]).startswith(".."):  # scripts land in bin/, outside
                    rows.append((row[0], int(row[2]) if len(row) > 2 and row[2] else None, row[1] or None))
        yield info, rows


def tree_stats(root: Path) -> tuple[int, int]:
    sizes = [os.lstat(os.path.join(d, n)).st_size for d, _, names in os.walk(root) for n in names]
    return len(sizes), sum(sizes)


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


def pack(site: Path, writer: PartWriter, codec: str, level: int):
    def add_tree(sink):
        with tarfile.open(fileobj=sink, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for dirpath, dirs, names in os.walk(site):
                dirs.sort()
                for n in sorted(names):  # sorted: the same tree packs to the same bytes
                    full = os.path.join(dirpath, n)
                    tar.add(full, os.path.relpath(full, site), recursive=False,
                            filter=lambda t: (setattr(t, "uid", 0), setattr(t, "gid", 0),
                                              setattr(t, "uname", ""), setattr(t, "gname", ""), t)[-1])
    if codec == "zstd":
        if not shutil.which("zstd"):
            raise SystemExit("the zstd CLI is missing: apt-get install zstd, or use --codec xz")
        cmd = ["zstd", "-q", "-c", "-T0", f"-{level}", "--long=27"]
    else:
        cmd = ["xz", "-q", "-c", "-T0", f"-{level}"] if shutil.which("xz") else None
    if cmd is None:  # stdlib lzma: one core, but no tool needed
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


def repo_tree_bytes() -> int:
    """What travels with every call besides the carried paths: tracked and untracked-unignored files."""
    try:
        names = subprocess.check_output(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO).split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(os.lstat(REPO / n.decode()).st_size for n in names if n and os.path.lexists(REPO / n.decode()))


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def plan(out: Path, manifest: dict) -> str:
    """The device calls: parts (and meta, .whl) packed into as few calls as the 64 MiB limit allows."""
    rel, tree = os.path.relpath(out, REPO), repo_tree_bytes()
    budget = CALL_LIMIT - tree - MIB  # a MiB of slack: the tree grows between build and calls
    items = [(f"{rel}/meta", folder_bytes(out / "meta"), "/tmp/bundle")]
    if whl := (REPO / ".whl").is_dir():  # bench/gpu_wheels.sh's wheels (megatron-core, pyzmq, ...)
        items.append((".whl", folder_bytes(REPO / ".whl"), "/tmp/whl"))
    items += [(f"{rel}/{p['folder']}", p["bytes"], "/tmp/bundle") for p in manifest["parts"]]
    calls: list[list] = []
    for item in sorted(items, key=lambda i: -i[1]):  # first fit, largest first
        if item[1] > budget:
            raise SystemExit(f"{item[0]} ({item[1] / MIB:.1f} MiB) cannot travel beside a {tree / MIB:.1f} MiB "
                             "tree: build with a smaller --part-size")
        call = next((c for c in calls if sum(i[1] for i in c) + item[1] <= budget), None)
        calls.append([item]) if call is None else call.append(item)
    lines = [f"Device calls for {manifest['name']}: {len(calls)}, back to back (the machine is given back 30 s "
             f"after a call and keeps /tmp, not the working tree, between calls). Working tree: {tree / MIB:.1f} MiB."]
    if rel.startswith(".."):
        lines.append(f"NOTE: {out} is outside the repository, so it cannot be carried; build under the repo.")
    for n, call in enumerate(calls, 1):
        dests = sorted({d for _, _, d in call})
        cmd = " && ".join([f"mkdir -p {' '.join(dests)}"] + [f"mv {path}/* {d}/" for path, _, d in call])
        if n < len(calls):
            cmd += " && ls /tmp/bundle | wc -l"
        else:
            cmd += (" && python3 -m bench.sglang_bundle unpack --parts /tmp/bundle --dest /tmp/sglang-site --check-held"
                    + (" && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site"
                       " /tmp/whl/*.whl" if whl else "")
                    + f" && export PYTHONPATH=/tmp/sglang-site{':/tmp/site' if whl else ''}:$PWD"
                    + " && PYTHONUNBUFFERED=1 python3 -m bench.gpu_acceptance --device cuda --out $OUT/acceptance")
        size = tree + sum(i[1] for i in call)
        lines += [f"call {n}/{len(calls)} ({size / MIB:.1f} MiB travels)",
                  f"  carry: {json.dumps([path for path, _, _ in call])}", f"  command: {cmd}"]
    return "\n".join(lines) + "\n"


def build(a):
    started = time.time()
    out = (Path(a.out) / a.name).resolve()
    shutil.rmtree(out, ignore_errors=True)
    work = out / "work"
    work.mkdir(parents=True)
    versions = {norm(k): v for k, v in HELD_VERSIONS.items()}
    versions.update({norm(h.split("==")[0]): h.split("==")[1] for h in a.held if "==" in h})
    held = {norm(n) for n in HELD_NAMES} | set(versions) | {norm(h.split("==")[0]) for h in a.held}
    for name in map(norm, a.carry):
        held.discard(name)
        versions.pop(name, None)
    vpy = make_venv(find_python(a.python), work / "venv", versions)
    seconds = {}
    if a.from_wheels:
        wheels, info = sorted(Path(a.from_wheels).glob("*.whl")), {"held_required": {}, "replaced": []}
    else:
        t = time.time()
        items, info = resolve(a, vpy, held, versions, work)
        seconds["resolve"] = time.time() - t
        t = time.time()
        wheels = download(items, Path(a.cache).resolve(), vpy, a.pip_args)
        seconds["download"] = time.time() - t
    t = time.time()
    site = work / "site"
    run([sys.executable, "-m", "pip", "--python", vpy, "install", "--no-deps", "--no-index", "--no-compile",
         "--quiet", "--target", site, *wheels])
    seconds["install"] = time.time() - t
    files, size = tree_stats(site)
    records, owners = list(dist_records(site)), {}
    dists = [{"dist": d.name, "files": len(rows), "bytes": sum(r[1] or 0 for r in rows)} for d, rows in records]
    for d, rows in records:
        for row in rows:
            owners.setdefault(row[0], []).append(d.name)
    # a path two wheels ship (flashinfer and torch_c_dlpack_ext both have build_backend.py): the last
    # install wins, so the other's RECORD size is stale and unpack must not hold the file to it
    shared = {path: names for path, names in owners.items() if len(names) > 1}
    t = time.time()
    writer = PartWriter(out, f"{a.name}.tar.{'zst' if a.codec == 'zstd' else 'xz'}", a.part_size)
    pack(site, writer, a.codec, a.level)
    seconds["pack"] = time.time() - t
    (meta := out / "meta").mkdir()
    decoder = [w for w in wheels if w.name.startswith("zstandard-")]
    for w in decoder:  # the device may lack the zstd CLI: this wheel lets unpack decompress anyway
        shutil.copy(w, meta / w.name)
    manifest = {
        "name": a.name, "requested": a.packages, "codec": a.codec, "level": a.level, "long": 27,
        "python": subprocess.check_output(  # version and tag
            [vpy, "-c", "import sys; print(sys.version.split()[0], 'cp%d%d' % sys.version_info[:2])"],
            text=True).split(),
        "wheels": [{"file": w.name, "name": w.name.split("-")[0], "version": w.name.split("-")[1],
                    "bytes": w.stat().st_size, "sha256": sha256(w)} for w in wheels],
        "held": {n: versions.get(n) for n in sorted(held)}, **info,
        "install": {"files": files, "bytes": size, "dists": dists, "shared_paths": shared},
        "parts": writer.parts, "decoder_wheel": decoder[0].name if decoder else None,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    (meta / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if not a.keep_site:
        shutil.rmtree(work)  # ~3.5 GB for sglang; the wheels stay in the cache
    text = plan(out, manifest)
    (out / "plan.txt").write_text(text)
    packed = sum(p["bytes"] for p in writer.parts)
    print(f"\n{a.name}: {len(wheels)} wheels, {sum(w['bytes'] for w in manifest['wheels']) / 1e6:.1f} MB; "
          f"installed {files} files, {size / 1e6:.1f} MB; packed {packed / 1e6:.1f} MB ({a.codec} -{a.level}) in "
          f"{len(writer.parts)} parts of <= {a.part_size / MIB:g} MiB; seconds {manifest['seconds']}; "
          f"total {time.time() - started:.0f} s")
    risky = [f"{n} {versions.get(n) or '?'}: {r}" for n, reqs in sorted(info["held_required"].items())
             for r in reqs if any(op in r for op in ("==", "<", "~="))]  # what an unseen version may break
    print(f"held (not carried): {len(held)} packages; pins and upper bounds on them, for --check-held there:")
    print("  " + "\n  ".join(risky))
    print("excluded although required:", ", ".join(info.get("excluded", [])) or "none")
    for r in info["replaced"]:
        print(f"carried over the machine's: {r['name']} {r['machine']} -> {r['carried']}")
    for path, names in shared.items():
        print(f"installed by more than one wheel (the last one's copy kept): {path} {names}")
    for p in writer.parts:
        print(f"  {p['folder']}/{p['file']}  {p['bytes']} bytes  sha256 {p['sha256'][:16]}")
    print("\n" + text)


def locate(parts_dir: Path, folder: str, name: str) -> Path | None:
    """A bundle file as moved aside on the device (all in one folder) or as built here (in folders)."""
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
            raise SystemExit("cannot decompress: no zstd CLI, no zstandard module, no carried zstandard wheel")
        tmp = tempfile.mkdtemp(prefix="zstandard-")
        atexit.register(shutil.rmtree, tmp, True)
        zipfile.ZipFile(wheel).extractall(tmp)
        sys.path.insert(0, tmp)
        import zstandard
    return zstandard.ZstdDecompressor(max_window_size=1 << 27).stream_reader(stream), None


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
    for info, rows in dist_records(dest):
        for rel, nbytes, digest in rows:
            path = dest / rel
            if not os.path.lexists(path):
                problems.append(f"{info.name}: {rel} missing")
            elif rel in want.get("shared_paths", {}):
                continue
            elif nbytes is not None and path.stat().st_size != nbytes:
                problems.append(f"{info.name}: {rel} has {path.stat().st_size} bytes, RECORD says {nbytes}")
            elif a.verify_hashes and digest:
                algo, _, b64 = digest.partition("=")
                got = base64.urlsafe_b64encode(file_hash(path, algo).digest()).rstrip(b"=").decode()
                if got != b64:
                    problems.append(f"{info.name}: {rel} hash differs from RECORD")
    if problems:
        raise SystemExit("extracted tree does not match:\n  " + "\n  ".join(problems[:20]))
    print(f"OK: {files} files, {size / 1e6:.1f} MB, {len(want['dists'])} distributions in {dest} "
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("build", help="resolve, download, install, pack and split (the default)")
    b.add_argument("--packages", nargs="+", default=[ROOT_SPEC], help="what to bundle instead of sglang")
    b.add_argument("--from-wheels", help="bundle these wheels as they are, with no resolving or download")
    b.add_argument("--name", help="bundle name (default: from the first package)")
    b.add_argument("--out", default=str(REPO / ".bundle"))
    b.add_argument("--cache", default=str(REPO / ".bundle" / "cache"), help="downloaded wheels, kept across builds")
    b.add_argument("--python", help="a Python 3.12 to resolve for (default: one found here)")
    b.add_argument("--held", nargs="*", default=[], help="more NAME[==VER] the machine has")
    b.add_argument("--carry", nargs="*", default=[], help="carry these even though the machine has them")
    b.add_argument("--exclude", nargs="*", default=[], help="leave these out although required")
    b.add_argument("--find-links")
    b.add_argument("--no-index", action="store_true")
    b.add_argument("--codec", choices=["zstd", "xz"], default="zstd")
    b.add_argument("--level", type=int, help="compression level (default: zstd 10, xz 6)")
    b.add_argument("--part-size", type=size_arg, default=56 * MIB, help="e.g. 56M, 64K")
    b.add_argument("--keep-site", action="store_true", help="keep the install folder (work/site)")
    pl = sub.add_parser("plan", help="print the device calls again, for the working tree as it is now")
    pl.add_argument("bundle", nargs="?", default=str(REPO / ".bundle" / ROOT_SPEC.replace("==", "-")))
    u = sub.add_parser("unpack", help="verify the parts, decompress, extract, check against the manifest")
    u.add_argument("--parts", required=True, help="folder holding the parts and manifest.json (searched below)")
    u.add_argument("--dest", required=True)
    u.add_argument("--decoder", choices=["auto", "cli", "module"], default="auto")
    u.add_argument("--verify-hashes", action="store_true", help="also check every file's RECORD hash")
    u.add_argument("--check-held", action="store_true", help="check this machine's held packages' versions")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv if argv[:1] in (["build"], ["unpack"], ["plan"]) or "-h" in argv else ["build", *argv])
    if a.cmd == "unpack":
        return unpack(a)
    if a.cmd == "plan":
        out = Path(a.bundle).resolve()
        text = plan(out, json.loads((out / "meta" / "manifest.json").read_text()))
        (out / "plan.txt").write_text(text)
        return print(text)
    a.level = a.level or (10 if a.codec == "zstd" else 6)
    a.exclude = {norm(n) for n in a.exclude}
    a.name = a.name or (Path(a.from_wheels).name if a.from_wheels else a.packages[0].replace("==", "-"))
    a.pip_args = (["--find-links", a.find_links] if a.find_links else []) + (["--no-index"] if a.no_index else [])
    build(a)


if __name__ == "__main__":
    main()
