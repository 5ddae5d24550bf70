"""SGLang 0.5.17 for the GPU machine, as a bundle that one device call carries.

The GPU machine has Python 3.12 with torch 2.11.0 (+cu130) and a long list of packages, but no
package index; sglang 0.5.17 is the newest release that pins that torch. A lent GPU window has 15
minutes of device time and a call carries at most 64 MiB (working tree included), so the bundle
must be one part. Here, where pip reaches the index::

    python -m bench.tools.sglang_bundle build [--resolve]     # -> .bundle/sglang-0.5.17/ (git-ignored)
    python -m bench.tools.sglang_bundle plan                  # the one device call, for today's tree
    python -m bench.tools.sglang_bundle unpack --parts DIR --dest /tmp/sglang-site [--check-held]

``build --resolve`` (or a build without a lock) resolves sglang for Python 3.12 on x86-64 Linux *on
top of the machine's packages* and writes the lock ``bench/tools/locks/sglang-0.5.17.json`` (tracked):
every wheel pip picks, by URL, sha256 and size. A build from the lock runs no resolver (pip's took
87-273 s here) and fetches the same wheels; the same wheels pack to the same bytes. The machine's
packages are modelled by stub ``.dist-info`` folders (name and version only) in a Python 3.12 venv,
so pip keeps what is there and lists what must come along, including the machine packages whose
versions sglang cannot use (tokenizers, transformers): those are carried and shadow the machine's on
PYTHONPATH. Packages the machine has in an unknown version are never carried; ``unpack
--check-held`` checks, there, that their installed versions meet what the carried wheels require.

Of the 118 wheels resolved, only those that the offline Engine path imports are carried (the
allowlist below, 44); the rest are recorded in the manifest as left out. Files of carried wheels that
this path never loads are deleted before packing (the prune list below) and recorded in the manifest,
whose RECORD check on unpack skips exactly them. The tree (~0.32 GB) is packed as tar + ``xz -9``
(~47 MiB): the stdlib decodes it on the device with no tool. ``--codec zstd`` packs for the zstd CLI, the
zstandard module or a carried zstandard wheel. ``build --packages NAME==VER --find-links DIR
--no-index --lock FILE`` or ``--from-wheels DIR`` make a small bundle through the same code (the test
suite does). ``plan`` (also ``plan.txt``) prints the one device call: carry the part and meta folders
(and ``.whl`` from bench/gpu/wheels.sh), run ``bench.gpu.run`` on the bundle; it refuses a call over
64 MiB.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.tools.bundle_pack import PartWriter, dist_records, install, pack, prune, tree_stats
from bench.tools.bundle_resolve import MIB, download, find_python, make_venv, norm, read_lock, req_name, resolve, sha256
from bench.tools.bundle_unpack import unpack

REPO = Path(__file__).resolve().parents[2]
ROOT_SPEC = "sglang==0.5.17"
CALL_LIMIT = 64 * MIB  # the device tool's limit per call: working tree plus carried paths
GPU_RUN = "python3 -m bench.gpu.run --bundle {bundle} --budget-s 540 --out $OUT"  # 540 s: 60 s under timeout_s
TIMEOUT_S = 600  # the device tool's most for one command

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


# What sglang 0.5.17's offline Engine path (engine, scheduler, model runner, Qwen2, sampler, triton attention,
# model loader, model registry) imports, traced on CPU by carrying nothing and adding back what an unguarded
# import needed: 44 of the 118 wheels. Never imported there: CUDA compiler wheels, cutlass-dsl, tilelang,
# tokenspeed, z3, deep-gemm, helion, outlines/llguidance, modelscope, datasets, audio/video, gRPC, numpy 2.3.5
# (pip picked it for mistral-common's numpy<2.4; left out, the machine's 2.5.2 serves).
SGLANG_ALLOW = frozenset("""
sglang sglang-kernel flashinfer-python xgrammar apache-tvm-ffi transformers tokenizers torch-memory-saver
pyzmq orjson pybase64 msgspec setproctitle dill partial-json-parser compressed-tensors loguru gguf
pydantic pydantic-core typing-inspection annotated-types openai distro sniffio jiter
uvicorn fastapi starlette opentelemetry-api
ipython ipython-pygments-lexers jedi parso matplotlib-inline traitlets prompt-toolkit wcwidth stack-data
executing asttokens pure-eval pexpect ptyprocess
""".split())
# Files of carried wheels that the offline Engine with attention_backend="triton" on compute capability 9.0
# never loads: (fnmatch pattern, where it would be loaded). sglang-kernel's dist-info stays: sglang's
# engine.py:1636 checks its version.
SGLANG_PRUNE = {
    "sglang-kernel": [
        ("sgl_kernel/flash_ops.abi3.so", "FA3 (1.07 GiB): imported by sgl_kernel/flash_attn.py:8, i.e. only by "
                                         "attention_backend='fa3' "
                                         "(srt/layers/attention/flashattention_backend.py:254)"),
        ("sgl_kernel/sm100/*", "non-Hopper common_ops: on compute capability 9.0 sgl_kernel/load_utils.py:60-61 "
                               "loads sm90/"),
        ("sgl_kernel/infllm_ops*", "InfLLM-V2 attention, loaded on first call (sgl_kernel/infllm_v2/attention.py:40)"),
        ("sgl_kernel/flashmla_ops*", "MLA models only; sgl_kernel/flash_mla.py:7 imports it under try"),
    ],
    "xgrammar": [("xgrammar/lib/libxgrammar.a", "static library for C++ builds; Python loads "
                                                "xgrammar/libxgrammar_bindings.so")],
    "sglang": [
        ("sglang/srt/server/_core.*", "Rust HTTP server (srt/managers/rust_server.py:59), not the offline Engine"),
        ("sglang/srt/grpc/_core.*", "native gRPC server, only with --grpc-port (srt/entrypoints/http_server.py:2678)"),
        ("sglang/srt/multimodal/_core.*", "Rust image preprocessing for Inkling "
                                          "(srt/multimodal/inkling/image_processing_rust.py:13)"),
    ],
}
PROFILES = {"sglang-0.5.17": (SGLANG_ALLOW, SGLANG_PRUNE)}  # bundle name -> default allowlist and prune list


def select(lock: dict, allow: set[str] | None, held: set[str], versions: dict[str, str]):
    """The lock's wheels split into carried and left out; what the carried ones require of held packages."""
    resolved = {w["name"] for w in lock["wheels"]}
    if allow is not None and (unknown := sorted(allow - resolved)):
        raise SystemExit(f"the allowlist names {', '.join(unknown)}, which the resolution does not have: "
                         "fix the allowlist or re-resolve (--resolve)")
    carried = [w for w in lock["wheels"] if allow is None or w["name"] in allow]
    left_out = [{k: w[k] for k in ("name", "version", "bytes")} for w in lock["wheels"] if w not in carried]
    # pip replaces a stubbed version only when sglang cannot use it; left out, the machine's copy serves
    replaced = [{"name": w["name"], "machine": versions[w["name"]], "carried": w["version"]}
                for w in carried if w["name"] in versions]
    held = held - {r["name"] for r in replaced}
    held_required: dict[str, list[str]] = {}
    for w in carried:
        for text in w["requires"]:
            if req_name(text) in held:
                held_required.setdefault(req_name(text), []).append(f"{text} ({w['name']})")
    return carried, {"left_out": left_out, "replaced": replaced, "held_required": held_required}, held


def repo_tree_bytes() -> int:
    """What travels with every call besides the carried paths: tracked and untracked-unignored files."""
    try:
        names = subprocess.check_output(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO).split(b"\0")
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(os.lstat(REPO / n.decode()).st_size for n in names if n and os.path.lexists(REPO / n.decode()))


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def one_call_room() -> int:
    """The most a bundle's parts may weigh to travel in one call beside today's tree and .whl."""
    whl = folder_bytes(REPO / ".whl") if (REPO / ".whl").is_dir() else 0
    return CALL_LIMIT - repo_tree_bytes() - whl - MIB  # a MiB for meta and for the tree's growth


def plan(out: Path, manifest: dict) -> str:
    """The one device call: carry the parts and meta (and .whl), run bench.gpu.run on the bundle."""
    rel = os.path.relpath(out, REPO)
    if rel.startswith(".."):
        raise SystemExit(f"{out} is outside the repository {REPO}: the device tool carries only paths under it "
                         "(build with --out under the repository)")
    carry = [f"{rel}/{p['folder']}" for p in manifest["parts"]] + [f"{rel}/meta"]
    if (REPO / ".whl").is_dir():  # bench/gpu/wheels.sh's wheels (megatron-core, ...)
        carry.append(".whl")
    tree, carried = repo_tree_bytes(), sum(folder_bytes(REPO / c) for c in carry)
    travels = tree + carried
    if travels > CALL_LIMIT:
        raise SystemExit(f"{manifest['name']} does not fit one device call: {travels / MIB:.1f} MiB would travel "
                         f"(working tree {tree / MIB:.1f} + carried {carried / MIB:.1f}), the limit is "
                         f"{CALL_LIMIT / MIB:.0f} MiB: prune more, leave more out, or pack harder")
    return "\n".join([
        f"One device call for {manifest['name']}: {travels / MIB:.1f} MiB travels (working tree {tree / MIB:.1f} "
        f"MiB + carried {carried / MIB:.1f} MiB; the limit is {CALL_LIMIT / MIB:.0f} MiB)",
        f"  carry: {json.dumps(carry)}",
        f"  command: {GPU_RUN.format(bundle=rel)}",
        f"  timeout_s: {TIMEOUT_S}"]) + "\n"


def held_inputs(a) -> tuple[dict[str, str], set[str]]:
    """The machine's packages as stubbed (name -> version) and as all names, after --held and --carry."""
    versions = {norm(k): v for k, v in HELD_VERSIONS.items()}
    versions.update({norm(h.split("==")[0]): h.split("==")[1] for h in a.held if "==" in h})
    held = {norm(n) for n in HELD_NAMES} | set(versions) | {norm(h.split("==")[0]) for h in a.held}
    for name in map(norm, a.carry):
        held.discard(name)
        versions.pop(name, None)
    return versions, held


def wheel_entry(path: Path) -> dict:
    return {"file": path.name, "name": norm(path.name.split("-")[0]), "version": path.name.split("-")[1],
            "bytes": path.stat().st_size, "sha256": sha256(path)}


def locked_wheels(a, versions: dict[str, str], held: set[str], vpy: str, work: Path, seconds: dict):
    """The lock (read, or resolved and written), narrowed by the allowlist, its carried wheels downloaded."""
    inputs = {"packages": a.packages, "held": {n: versions.get(n) for n in sorted(held)}}
    lock_path = Path(a.lock).resolve()
    if a.resolve or not lock_path.exists():
        t = time.time()
        lock = resolve(inputs, vpy, held - set(versions), a.pip_args, work)
        seconds["resolve"] = time.time() - t
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        lock_path.write_text(json.dumps(lock, indent=1) + "\n")
        print(f"wrote the lock {lock_path} ({len(lock['wheels'])} wheels resolved)")
    else:
        lock = read_lock(lock_path, inputs)
        print(f"from the lock {lock_path}: no resolving (--resolve to redo it)")
    carried, info, held = select(lock, a.allow, held, versions)
    t = time.time()
    wheels = download(carried, Path(a.cache).resolve(), vpy, a.pip_args)
    seconds["download"] = time.time() - t
    entries = [{"file": w["file"], "name": w["name"], "version": w["version"], "bytes": path.stat().st_size,
                "sha256": w["sha256"]} for w, path in zip(carried, wheels)]
    info["lock"] = {"path": os.path.relpath(lock_path, REPO), "sha256": sha256(lock_path)}
    return wheels, entries, info, held


def build(a):
    started, seconds = time.time(), {}
    out = (Path(a.out) / a.name).resolve()
    shutil.rmtree(out, ignore_errors=True)
    work = out / "work"
    work.mkdir(parents=True)
    versions, held = held_inputs(a)
    vpy = make_venv(find_python(a.python), work / "venv", versions)
    if a.from_wheels:
        wheels = sorted(Path(a.from_wheels).glob("*.whl"))
        entries, info = [wheel_entry(w) for w in wheels], {"left_out": [], "replaced": [], "held_required": {},
                                                           "lock": None}
    else:
        wheels, entries, info, held = locked_wheels(a, versions, held, vpy, work, seconds)
    t = time.time()
    site = work / "site"
    scripts = install(entries, Path(a.from_wheels or a.cache).resolve(), vpy, site)
    seconds["install"] = time.time() - t
    t = time.time()
    pruned = prune(site, {dist: [g for g, _ in globs] for dist, globs in a.prune.items()})
    seconds["prune"] = time.time() - t
    files, size = tree_stats(site)
    records, owners = list(dist_records(site)), {}
    dists = [{"dist": d.name, "files": len(rows), "bytes": sum(r[1] or 0 for r in rows)} for d, rows in records]
    for d, rows in records:
        for row in rows:
            owners.setdefault(row[0], []).append(d.name)
    # a path two wheels ship (with --carry-all, flashinfer and torch_c_dlpack_ext both have build_backend.py):
    # the last install wins, so the other's RECORD size is stale and unpack must not hold the file to it
    shared = {path: names for path, names in owners.items() if len(names) > 1}
    t = time.time()
    writer = PartWriter(out, f"{a.name}.tar.{'zst' if a.codec == 'zstd' else 'xz'}", a.part_size or one_call_room())
    pack(site, writer, a.codec, a.level)
    seconds["pack"] = time.time() - t
    (meta := out / "meta").mkdir()
    decoder = [w for w in wheels if w.name.startswith("zstandard-")]
    for w in decoder:  # the device may lack the zstd CLI: this wheel lets unpack decompress a zstd bundle anyway
        shutil.copy(w, meta / w.name)
    manifest = {
        "name": a.name, "requested": a.packages, "codec": a.codec, "level": a.level,
        "python": subprocess.check_output(  # version and tag
            [vpy, "-c", "import sys; print(sys.version.split()[0], 'cp%d%d' % sys.version_info[:2])"],
            text=True).split(),
        "wheels": entries, "allow": sorted(a.allow) if a.allow is not None else None,
        "held": {n: versions.get(n) for n in sorted(held)}, **info,
        "prune": {dist: [{"glob": g, "why": why} for g, why in globs] for dist, globs in a.prune.items()},
        "pruned": pruned, "scripts_dropped": scripts,
        "install": {"files": files, "bytes": size, "dists": dists, "shared_paths": shared},
        "parts": writer.parts, "decoder_wheel": decoder[0].name if decoder else None,
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
    }
    if not a.keep_site:  # the wheels stay in the cache; ~20k unlinks, a minute on this machine's disk
        t = time.time()
        shutil.rmtree(work)
        manifest["seconds"]["cleanup"] = round(time.time() - t, 1)
    (meta / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    summarize(manifest, time.time() - started)
    if not out.is_relative_to(REPO / ".bundle"):  # the suite's fast-codec copy (.cache/) is not for the device
        return print(f"\n{out} is outside the repository's .bundle/: no device call planned (plan BUNDLE prints one)")
    text = plan(out, manifest)
    (out / "plan.txt").write_text(text)
    print("\n" + text)


def summarize(manifest: dict, total_s: float):
    def mb(rows):
        return sum(r["bytes"] or 0 for r in rows) / 1e6
    parts, install = manifest["parts"], manifest["install"]
    print(f"\n{manifest['name']}: carried {len(manifest['wheels'])} wheels ({mb(manifest['wheels']):.1f} MB), left out "
          f"{len(manifest['left_out'])} ({mb(manifest['left_out']):.1f} MB); installed {install['files']} files, "
          f"{install['bytes'] / 1e6:.1f} MB after pruning {len(manifest['pruned'])} files "
          f"({mb(manifest['pruned']):.1f} MB); packed {sum(p['bytes'] for p in parts) / MIB:.1f} MiB "
          f"({manifest['codec']} -{manifest['level']}) in {len(parts)} part(s); seconds {manifest['seconds']}; "
          f"total {total_s:.0f} s")
    print("left out:", ", ".join(f"{w['name']} {w['version']}" for w in manifest["left_out"]) or "none")
    risky = [f"{n} {manifest['held'].get(n) or '?'}: {r}" for n, reqs in sorted(manifest["held_required"].items())
             for r in reqs if any(op in r for op in ("==", "<", "~="))]  # what an unseen version may break
    print(f"held (not carried): {len(manifest['held'])} packages; pins and upper bounds on them, for --check-held "
          "there:\n  " + "\n  ".join(risky))
    for r in manifest["replaced"]:
        print(f"carried over the machine's: {r['name']} {r['machine']} -> {r['carried']}")
    for path, names in manifest["install"]["shared_paths"].items():
        print(f"installed by more than one wheel (the last one's copy kept): {path} {names}")
    for p in parts:
        print(f"  {p['folder']}/{p['file']}  {p['bytes']} bytes  sha256 {p['sha256'][:16]}")


def prune_arg(text: str) -> tuple[str, str]:
    dist, sep, pattern = text.partition(":")
    if not (sep and dist and pattern):
        raise argparse.ArgumentTypeError(f"{text!r}: expected DIST:GLOB, e.g. sglang-kernel:sgl_kernel/sm100/*")
    return norm(dist), pattern


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": MIB, "G": 1 << 30}
    text = text.upper().rstrip("IB")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd")
    b = sub.add_parser("build", help="resolve (or read the lock), download, install, prune, pack (the default)")
    b.add_argument("--packages", nargs="+", default=[ROOT_SPEC], help="what to bundle instead of sglang")
    b.add_argument("--from-wheels", help="bundle these wheels as they are, with no resolving, lock or download")
    b.add_argument("--name", help="bundle name (default: from the first package)")
    b.add_argument("--out", default=str(REPO / ".bundle"), help="the bundle goes to OUT/NAME")
    b.add_argument("--cache", default=str(REPO / ".bundle" / "cache"), help="downloaded wheels, kept across builds")
    b.add_argument("--lock", help="the lock file (default: bench/tools/locks/NAME.json)")
    b.add_argument("--resolve", action="store_true", help="resolve again and rewrite the lock")
    b.add_argument("--python", help="a Python 3.12 to resolve and install for (default: one found here)")
    b.add_argument("--held", nargs="*", default=[], help="more NAME[==VER] the machine has")
    b.add_argument("--carry", nargs="*", default=[], help="carry these even though the machine has them")
    b.add_argument("--allow", nargs="+", help="carry only these of the resolved wheels (default: the bundle's "
                                              "allowlist, for sglang-0.5.17 the Engine path's 44)")
    b.add_argument("--carry-all", action="store_true", help="carry every resolved wheel: no allowlist")
    b.add_argument("--prune", nargs="*", type=prune_arg, help="DIST:GLOB files to delete before packing, instead "
                                                              "of the bundle's prune list (none: prune nothing)")
    b.add_argument("--find-links", help="a folder of wheels for pip (the tests' offline index)")
    b.add_argument("--no-index", action="store_true")
    b.add_argument("--codec", choices=["xz", "zstd"], default="xz")
    b.add_argument("--level", type=int, help="compression level (default: xz 9, zstd 19)")
    b.add_argument("--part-size", type=size_arg, help="e.g. 56M, 64K (default: what fits one call beside the tree)")
    b.add_argument("--keep-site", action="store_true", help="keep the install folder (work/site)")
    pl = sub.add_parser("plan", help="print the device call again, for the working tree as it is now")
    pl.add_argument("bundle", nargs="?", default=str(REPO / ".bundle" / ROOT_SPEC.replace("==", "-")))
    u = sub.add_parser("unpack", help="verify the parts, decompress, extract, check against the manifest")
    u.add_argument("--parts", required=True, help="folder holding the parts and manifest.json (searched below)")
    u.add_argument("--dest", required=True)
    u.add_argument("--decoder", choices=["auto", "cli", "module"], default="auto", help="for zstd bundles")
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
    a.level = a.level if a.level is not None else (9 if a.codec == "xz" else 19)
    a.name = a.name or (Path(a.from_wheels).name if a.from_wheels else a.packages[0].replace("==", "-"))
    a.lock = a.lock or str(REPO / "bench" / "tools" / "locks" / f"{a.name}.json")
    a.pip_args = (["--find-links", a.find_links] if a.find_links else []) + (["--no-index"] if a.no_index else [])
    default_allow, default_prune = PROFILES.get(a.name, (None, {}))
    a.allow = None if a.carry_all else {norm(n) for n in a.allow} if a.allow else default_allow
    if a.allow is not None:
        a.allow = set(a.allow) | {norm(n) for n in a.carry}  # asked to carry: allowed
    given, a.prune = a.prune, default_prune if a.prune is None else {}
    for dist, pattern in given or []:
        a.prune.setdefault(dist, []).append((pattern, "given on the command line"))
    build(a)


if __name__ == "__main__":
    main()
