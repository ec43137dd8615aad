# syntax=docker/dockerfile:1
# Training image for B200 (SM100) clusters; the H200 (SM90) variant differs only in TORCH_CUDA_ARCH_LIST
# (docker-bake.hcl has both). CUDA 13.0 + cuDNN, PyTorch 2.11 (cu130 wheels, with the NCCL and NVSHMEM
# wheels it pins), torchao, liger-kernel, flash-attn-4 (CuTe DSL), DeepEP with HybridEP and DeepGEMM built
# from source at pinned commits, and this repository's three packages. Build from the repository root:
#   docker buildx bake                 # docker-bake.hcl; or:
#   docker build -f docker/cuda/llm-training.Dockerfile -t llm-training .
# Check the result with `bash docker/smoke_test.sh <image>` (no GPU needed).
#
# Where each pin was checked (2026-12-01; "dependencies.md" is docs/dependencies.md,
# measured on an H200 with torch 2.11.0+cu130):
# - CUDA_IMAGE: the tag is used by public CUDA 13 Dockerfiles (code search); 13.0 matches torch's cu130
#   wheels, which torch.utils.cpp_extension requires of nvcc when DeepEP / DeepGEMM are compiled. A devel
#   image because DeepGEMM and HybridEP compile kernels with nvcc at run time (JIT).
# - TORCH_VERSION 2.11.0 (cu130): dependencies.md (H200 machine). Its wheel pins nvidia-nccl-cu13==2.28.9
#   and nvidia-nvshmem-cu13==3.4.5 (lock files of public torch 2.11.0+cu130 environments; the torch
#   release table in sgl-project/sglang#38769: 3.4.5 for torch 2.11-2.14); NCCL 2.28.9 is also what the
#   H200 reports. NCCL_VERSION / NVSHMEM_VERSION repeat those pins so a drift fails the build in pip.
# - TORCHAO 0.18.0, LIGER_KERNEL 0.8.5, FLASH_ATTN_4 4.0.0b36 with NVIDIA_CUTLASS_DSL 4.8.1 (+ libs-cu13),
#   QUACK_KERNELS 0.6.5, APACHE_TVM_FFI 0.1.15.post2 (dependencies.md: <0.2), TORCH_C_DLPACK_EXT 0.1.5:
#   dependencies.md (run and measured on torch 2.11 cu130); the versions are on PyPI.
# - DEEPEP_COMMIT f725d296...: head of DeepEP's `hybrid-ep` branch pinned by pytorch/torchtitan#4033
#   (.ci/docker/common/install_deepep.sh, built there on CUDA 13 against the pip NVSHMEM); it carries
#   deepseek-ai/DeepEP#699 (no hard-coded -std=c++17 for hybrid_ep_cpp, which fails against current torch
#   headers). The branch holds both the classic deep_ep Buffer and HybridEP (hybrid_ep_cpp). It finds
#   NVSHMEM through the nvidia-nvshmem wheel torch brings, so it needs no NCCL beyond torch's: DeepEP's V2
#   kernels on `main` need NCCL >= 2.30.4 and are not built here. HYBRID_EP_MULTINODE=0 (the torchtitan
#   build): HybridEP inside one NVLink domain, which covers expert parallelism within a node; 1 adds
#   the RDMA inter-node path (needs rdma-core; not tried).
# - DEEPGEMM_COMMIT 477618cd...: deepseek-ai/DeepGEMM, the pin of vllm-project/vllm#33935 and llm-d/llm-d
#   #1367 (fixes an SM100 synchronisation issue); built with its git submodules (CUTLASS, fmt).
# - WANDB 0.31.0 (dependencies.md), TENSORBOARD 2.21.0, NVIDIA_ML_PY 13.615.71 (DeepEP's NVML binding),
#   PIP 26.3, SETUPTOOLS 84.2.1, WHEEL 0.48.0: released versions on PyPI.
# - TransformerEngine is not installed: nothing in llm_training uses it (dependencies.md: optional).
# Nothing is imported that needs a GPU at build time: the GPU packages are checked by module lookup only
# (find_spec), and docker/smoke_test.sh imports them with GPU=1 on a GPU machine.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG NCCL_VERSION=2.28.9
ARG NVSHMEM_VERSION=3.4.5
ARG TORCHAO_VERSION=0.18.0
ARG LIGER_KERNEL_VERSION=0.8.5
ARG FLASH_ATTN_4_VERSION=4.0.0b36
ARG CUTLASS_DSL_VERSION=4.8.1
ARG QUACK_KERNELS_VERSION=0.6.5
ARG APACHE_TVM_FFI_VERSION=0.1.15.post2
ARG TORCH_C_DLPACK_EXT_VERSION=0.1.5
ARG WANDB_VERSION=0.31.0
ARG TENSORBOARD_VERSION=2.21.0
ARG NVIDIA_ML_PY_VERSION=13.615.71
ARG DEEPEP_REPO=https://github.com/deepseek-ai/DeepEP.git
ARG DEEPEP_COMMIT=f725d29699f5bda9ba789456bb9579af69844685
ARG HYBRID_EP_MULTINODE=0
ARG DEEPGEMM_REPO=https://github.com/deepseek-ai/DeepGEMM.git
ARG DEEPGEMM_COMMIT=477618cd51baffca09c4b0b87e97c03fe827ef03
# 10.0 = B200 (SM100); 9.0 = H100/H200 (SM90). DeepEP needs DISABLE_AGGRESSIVE_PTX_INSTRS=1 off SM90.
ARG TORCH_CUDA_ARCH_LIST=10.0
ARG MAX_JOBS=16

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda \
    PIP_CONSTRAINT=/opt/llm-training-constraints.txt

# Tools for the source builds (DeepEP, DeepGEMM, the start-up build of `activation`); rdma-core and the
# verbs headers for NVSHMEM's InfiniBand transport; libnvidia-ml-dev for HybridEP's NVML stubs.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-dev python3-venv git build-essential ninja-build ca-certificates \
      rdma-core libibverbs-dev libnvidia-ml-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && touch /opt/llm-training-constraints.txt \
 && pip install "pip==26.3" "setuptools==84.2.1" "wheel==0.48.0"

# torch and the NCCL / NVSHMEM wheels it pins, all from PyTorch's cu130 index (it carries torch's
# dependencies); then everything installed so far becomes a constraint
# (PIP_CONSTRAINT), so no later install can change torch, NCCL or NVSHMEM behind our back.
RUN pip install --index-url "${TORCH_INDEX_URL}" \
      "torch==${TORCH_VERSION}" "nvidia-nccl-cu13==${NCCL_VERSION}" "nvidia-nvshmem-cu13==${NVSHMEM_VERSION}" \
 && pip freeze > /opt/llm-training-constraints.txt

RUN pip install \
      "torchao==${TORCHAO_VERSION}" \
      "liger-kernel==${LIGER_KERNEL_VERSION}" \
      "flash-attn-4==${FLASH_ATTN_4_VERSION}" \
      "quack-kernels==${QUACK_KERNELS_VERSION}" \
      "nvidia-cutlass-dsl==${CUTLASS_DSL_VERSION}" \
      "nvidia-cutlass-dsl-libs-cu13==${CUTLASS_DSL_VERSION}" \
      "apache-tvm-ffi==${APACHE_TVM_FFI_VERSION}" \
      "torch-c-dlpack-ext==${TORCH_C_DLPACK_EXT_VERSION}" \
      "nvidia-ml-py==${NVIDIA_ML_PY_VERSION}" \
      "wandb==${WANDB_VERSION}" \
      "tensorboard==${TENSORBOARD_VERSION}"

# DeepEP (hybrid-ep branch: deep_ep + HybridEP). CUDA 13 keeps the CCCL headers under include/cccl; NVSHMEM's
# headers include <cuda/std/...>, hence the link. The driver library is linked from the toolkit's stubs
# (the real one comes from the host at run time).
RUN if [ -d /usr/local/cuda/include/cccl/cuda ] && [ ! -e /usr/local/cuda/include/cuda ]; then \
      ln -s /usr/local/cuda/include/cccl/cuda /usr/local/cuda/include/cuda; \
    fi \
 && git init -q /opt/src/DeepEP \
 && git -C /opt/src/DeepEP remote add origin "${DEEPEP_REPO}" \
 && git -C /opt/src/DeepEP fetch -q --depth 1 origin "${DEEPEP_COMMIT}" \
 && git -C /opt/src/DeepEP checkout -q FETCH_HEAD \
 && git -C /opt/src/DeepEP submodule update -q --init --recursive --depth 1 \
 && LIBRARY_PATH=/usr/local/cuda/lib64/stubs TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" \
    DISABLE_AGGRESSIVE_PTX_INSTRS=1 HYBRID_EP_MULTINODE="${HYBRID_EP_MULTINODE}" MAX_JOBS="${MAX_JOBS}" \
    pip install --no-build-isolation --no-deps /opt/src/DeepEP \
 && rm -rf /opt/src/DeepEP

RUN git init -q /opt/src/DeepGEMM \
 && git -C /opt/src/DeepGEMM remote add origin "${DEEPGEMM_REPO}" \
 && git -C /opt/src/DeepGEMM fetch -q --depth 1 origin "${DEEPGEMM_COMMIT}" \
 && git -C /opt/src/DeepGEMM checkout -q FETCH_HEAD \
 && git -C /opt/src/DeepGEMM submodule update -q --init --recursive --depth 1 \
 && LIBRARY_PATH=/usr/local/cuda/lib64/stubs TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" MAX_JOBS="${MAX_JOBS}" \
    pip install --no-build-isolation --no-deps /opt/src/DeepGEMM \
 && rm -rf /opt/src/DeepGEMM

# This repository. `activation` and `optimizer` are installed as regular (non-editable) packages: the
# project folder optimizer/ at the repository root would otherwise shadow the `optimizer` package as a
# namespace package whenever the root is first on sys.path (torchrun, python -m, python -c from here).
# llm_training itself is editable: the llm_training/ folder here is the package either way.
# scripts/build_activation_at_start.sh rebuilds `activation` at job start from the checkout the job uses.
WORKDIR /workspace/llm_training
COPY . .
RUN pip install --no-build-isolation --no-deps ./activations ./optimizer \
 && pip install --no-build-isolation -e ".[metrics]" \
 && rm -rf activations/build optimizer/build activations/*.egg-info optimizer/*.egg-info \
 && pip check \
 && python -c "import llm_training, activation, optimizer; from optimizer import GroupRule; import llm_training.trainer.optim" \
 && python -c "import importlib.util as u, sys; \
missing = [m for m in ('torchao', 'liger_kernel', 'flash_attn', 'cutlass', 'quack', 'deep_ep', 'deep_ep_cpp', \
'hybrid_ep_cpp', 'deep_gemm', 'wandb') if u.find_spec(m) is None]; \
sys.exit(f'modules missing from the image: {missing}' if missing else 0)"

# Multi-node launch (Kubeflow sets PET_*; see run_train_kubeflow.sh and examples/kubeflow/trainjob.yaml).
CMD ["bash", "run_train_kubeflow.sh"]
