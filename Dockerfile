# onehop: the `onehop` command (gateway, engine, serve) with the engine extra, CPU torch.
#
#   docker build -t onehop:latest .
#   docker run --rm -p 8000:8000 onehop:latest serve --host 0.0.0.0      # the tiny model
#   docker run --rm -p 8000:8000 -v $PWD/configs:/etc/onehop -v /models:/models:ro \
#       onehop:latest gateway --config /etc/onehop/gateway.yaml         # configs/k8s/gateway.yaml runs this
#
# GPU engines are vLLM's own images (configs/k8s/vllm-*.yaml); this one serves the gateway,
# and the hf or sim engine on CPUs.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/onehop

# torch at pyproject.toml's pin first, so `.[engine]` below finds it satisfied. The default
# index's Linux wheel is the CUDA build (gigabytes a CPU image never loads): point
# TORCH_INDEX_URL at a CPU wheel index for a smaller image.
ARG TORCH_INDEX_URL=""
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} torch==2.13.0

COPY pyproject.toml README.md ./
COPY engine ./engine
COPY gateway ./gateway
COPY onehop ./onehop
COPY wire ./wire
COPY derender ./derender
COPY plumbing ./plumbing
RUN pip install '.[engine]'

# Not root; a home for the tiny model's cache (`onehop serve` builds it on first run).
RUN useradd --system --uid 10001 --create-home onehop
USER 10001
WORKDIR /home/onehop

EXPOSE 8000
ENTRYPOINT ["onehop"]
CMD ["serve", "--host", "0.0.0.0"]
