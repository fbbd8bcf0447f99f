# syntax=docker/dockerfile:1
# vllm-guard gateway image: the proxy alone, in front of a vLLM server reached over the network.
#   docker build -t vllm-guard .
#   docker run -p 8080:8080 -e VLLM_GUARD_UPSTREAM=http://vllm:8000 vllm-guard
# Every setting is an environment variable VLLM_GUARD_<FIELD> (see .env.example and docs/deploy.md).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- build: one pure-Python wheel, so the final stage needs no compiler nor source tree -------------
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# -- runtime --------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS gateway
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/vllm-guard/bin:$PATH \
    HF_HOME=/home/guard/.cache/huggingface \
    VLLM_GUARD_HOST=0.0.0.0 \
    VLLM_GUARD_PORT=8080
RUN groupadd --system --gid 10001 guard \
    && useradd --system --uid 10001 --gid guard --create-home --home-dir /home/guard guard
COPY --from=build /dist/*.whl /tmp/wheels/
RUN python -m venv /opt/vllm-guard \
    && /opt/vllm-guard/bin/pip install --no-cache-dir /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels
USER 10001:10001
WORKDIR /home/guard
EXPOSE 8080
# Slim has no curl: python's urllib asks /health; any non-2xx answer or no answer marks it unhealthy.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os,urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('VLLM_GUARD_PORT', '8080'), timeout=4)"]
ENTRYPOINT ["vllm-guard"]
CMD ["serve"]
