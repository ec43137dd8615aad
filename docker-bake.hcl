# docker buildx bake: the training images from docker/cuda/llm-training.Dockerfile.
#   docker buildx bake                                            # B200 image, tag localhost:5000/llm-training:latest
#   REGISTRY=registry.example.com/team TAG=v0.1.0 docker buildx bake --push
#   docker buildx bake llm-training-cuda-h200                     # the SM90 (H100/H200) build
#   docker buildx bake all                                        # both
# The args override the Dockerfile's ARG defaults (tests/deploy/test_docker_files.py checks that each one
# is an ARG there). Check a built image with `bash docker/smoke_test.sh <tag>`.
variable "REGISTRY" {
  default = "localhost:5000"
}

variable "TAG" {
  default = "latest"
}

group "default" {
  targets = ["llm-training-cuda"]
}

group "all" {
  targets = ["llm-training-cuda", "llm-training-cuda-h200"]
}

# Shared by both images: build context, Dockerfile, platform.
target "_cuda-common" {
  context    = "."
  dockerfile = "docker/cuda/llm-training.Dockerfile"
  platforms  = ["linux/amd64"]
}

target "llm-training-cuda" {
  inherits = ["_cuda-common"]
  tags     = ["${REGISTRY}/llm-training:${TAG}", "${REGISTRY}/llm-training:${TAG}-sm100"]
  args = {
    TORCH_CUDA_ARCH_LIST = "10.0" # B200 (SM100)
    MAX_JOBS             = "16"
  }
}

target "llm-training-cuda-h200" {
  inherits = ["_cuda-common"]
  tags     = ["${REGISTRY}/llm-training:${TAG}-sm90"]
  args = {
    TORCH_CUDA_ARCH_LIST = "9.0" # H100 / H200 (SM90)
    MAX_JOBS             = "16"
  }
}
