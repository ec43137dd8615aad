# docker buildx bake: builds the B200 training image from docker/cuda/llm-training.Dockerfile.
#   REGISTRY=registry.example.com/team TAG=v0.1.0 docker buildx bake --push
variable "REGISTRY" {
  default = "localhost:5000"
}

variable "TAG" {
  default = "latest"
}

group "default" {
  targets = ["llm-training-cuda"]
}

target "llm-training-cuda" {
  context    = "."
  dockerfile = "docker/cuda/llm-training.Dockerfile"
  platforms  = ["linux/amd64"]
  tags       = ["${REGISTRY}/llm-training:${TAG}"]
  args = {
    TORCH_CUDA_ARCH_LIST = "10.0" # B200 (SM100)
  }
}
