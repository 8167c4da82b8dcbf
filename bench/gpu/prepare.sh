#!/usr/bin/env bash
# Build here (with network) the wheels bench/gpu/run_all.sh installs on an offline GPU
# machine that has Python 3.12 and CUDA torch but, of our dependencies, no deepspeed,
# megatron-core, pydantic, hjson (it is assumed to have numpy, pyyaml, sentencepiece,
# einops, msgpack, psutil, py-cpuinfo, ninja, tqdm, packaging).
# Writes .whl/ (git-ignored; copy it to the machine with the checkout), < 64 MiB.
# Runs from any checkout, with the pip of the Python on the PATH (PIP: another, e.g. a
# virtualenv's "python -m pip"; deepspeed's wheel builds faster where torch imports).
#   bash bench/gpu/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PIP="${PIP:-python3 -m pip}"
rm -rf .whl && mkdir -p .whl
# deepspeed is an sdist: a pure-Python wheel (its ops JIT-build there with ninja + g++)
DS_BUILD_OPS=0 $PIP wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8 \
    || DS_BUILD_OPS=0 $PIP wheel -q --no-deps -w .whl deepspeed==0.19.8
binary() {  # $@: name==version, for CPython 3.12 on manylinux x86_64
    $PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d .whl "$@"
}
binary megatron-core==0.16.1
binary pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0
binary hjson==3.1.0
ls -la .whl
du -sh .whl
