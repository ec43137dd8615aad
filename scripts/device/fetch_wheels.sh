#!/usr/bin/env bash
# Run HERE (a machine with internet, any CPU): downloads the optional GPU wheels the GPU suite and the benchmarks
# use into .whl/ (Python 3.12, x86-64, for the offline H200) and packs flash-attn-4's 92 MB cu13 libraries into
# .cu13/cu13.{1,2}of2.tar.xz (13 + 50 MiB), which scripts/device/wheels.sh installs there. Both folders are
# git-ignored. A device call carries at most 64 MiB, so the set travels in three calls while the machine stays
# warm (30 s between calls):
#   1. carry [".whl", ".cu13/cu13.1of2.tar.xz"]  then run anything that needs torchao (FP8 tests)
#   2. carry [".cu13/cu13.2of2.tar.xz"]          the cu13 libs are complete: flash-attn-4 installs now
#   3. bash scripts/gpu_check.sh tests           the whole GPU suite (flash-attn-4 included)
# Every call starts with `source scripts/device/wheels.sh` (gpu_check.sh does it itself).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.cu13/' .git/info/exclude 2>/dev/null || echo '/.cu13/' >> .git/info/exclude
mkdir -p .whl .cu13
# torchao: the [quantize] kernels; liger-kernel: fused CE; flash-attn-4 and its CuTe DSL stack: the fa4 attention
# backend; datasets (+ dill, multiprocess): the Hub / save_to_disk data sources (the image lacks these three)
wheels=(torchao==0.18.0 liger-kernel==0.8.5 flash-attn-4==4.0.0b36 quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1 "apache-tvm-ffi<0.2" torch-c-dlpack-ext
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl "${wheels[@]}"
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d "$tmp" nvidia-cutlass-dsl-libs-cu13==4.8.1
(cd "$tmp" && unzip -q nvidia_cutlass_dsl_libs_cu13-*.whl && rm nvidia_cutlass_dsl_libs_cu13-*.whl \
  && tar cf - --exclude=./nvidia_cutlass_dsl/dsl_packages . | xz -9 -T2 > "$ROOT/.cu13/cu13.1of2.tar.xz" \
  && tar cf - ./nvidia_cutlass_dsl/dsl_packages | xz -9 -T2 > "$ROOT/.cu13/cu13.2of2.tar.xz")
rm -rf "$tmp"
du -sh .whl .cu13/*
