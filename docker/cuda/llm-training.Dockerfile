# syntax=docker/dockerfile:1
# Production image for B200 (SM100) clusters: CUDA 13 + cuDNN, PyTorch (cu130 wheels), torchao (MXFP8),
# liger-kernel (fused linear cross-entropy), flash-attn-4 (CuTe DSL attention), DeepEP built from source
# at a pinned commit (PyPI's deep-ep is a stale placeholder), and this repository's three packages.
# Build from the repository root (docker-bake.hcl does this):
#   docker buildx bake            # or: docker build -f docker/cuda/llm-training.Dockerfile -t llm-training .
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
ARG TORCHAO_VERSION=0.18.0
ARG LIGER_KERNEL_VERSION=0.8.5
ARG FLASH_ATTN_4_VERSION=4.0.0b36
ARG CUTLASS_DSL_VERSION=4.8.1
ARG QUACK_KERNELS_VERSION=0.6.5
# DeepEP: the commit is pinned for reproducible builds; its setup.py finds NVSHMEM through the
# nvidia-nvshmem pip package. SM100 builds need DISABLE_AGGRESSIVE_PTX_INSTRS=1.
ARG DEEPEP_COMMIT=060b180416d94427aa64f5394bd0c2955def55e2
ARG TORCH_CUDA_ARCH_LIST=10.0

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}

RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 python3-dev python3-venv git build-essential ninja-build ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && pip install --upgrade pip setuptools wheel

RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

RUN pip install \
      "torchao==${TORCHAO_VERSION}" \
      "liger-kernel==${LIGER_KERNEL_VERSION}" \
      "flash-attn-4==${FLASH_ATTN_4_VERSION}" \
      "quack-kernels==${QUACK_KERNELS_VERSION}" \
      "nvidia-cutlass-dsl==${CUTLASS_DSL_VERSION}" \
      "nvidia-cutlass-dsl-libs-cu13==${CUTLASS_DSL_VERSION}" \
      nvidia-nvshmem-cu13 \
      wandb tensorboard

RUN git clone https://github.com/deepseek-ai/DeepEP.git /opt/DeepEP \
 && cd /opt/DeepEP \
 && git checkout "${DEEPEP_COMMIT}" \
 && TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" DISABLE_AGGRESSIVE_PTX_INSTRS=1 \
    pip install --no-build-isolation . \
 && python -c "import deep_ep"

WORKDIR /workspace/llm_training
COPY . .
RUN pip install -e activations -e optimizer -e ".[metrics]" \
 && python -c "import llm_training, activation, optimizer"

# Multi-node launch (Kubeflow sets PET_*; see run_train_kubeflow.sh and examples/kubeflow/trainjob.yaml).
CMD ["bash", "run_train_kubeflow.sh"]
