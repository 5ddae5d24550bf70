#!/usr/bin/env bash
# Wheels the GPU acceptance machine lacks, for its Python 3.12 (it has torch, transformers,
# numpy, safetensors, matplotlib, pyarrow and psutil, but no package index). Run here, where pip
# reaches the index; the wheels land in .whl/ (ignored by git, about 5 MB) and travel with the
# working tree. On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 -m bench.gpu.acceptance --device cuda --out OUT
set -euo pipefail
cd "$(dirname "$0")/../.."
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
# megatron-core: the trainer; pyzmq: the coordinator's request plane; math-verify and its
# pure-Python requirements: the reward pool's math scorer (imported by the program's workers).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  megatron-core==0.16.1 "pyzmq>=25" "math-verify>=0.7" latex2sympy2_extended==1.11.0 \
  "antlr4-python3-runtime>=4.9.3,<=4.13.2"
ls -l .whl
