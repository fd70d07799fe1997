# kvstash: the engine, the cache server and the admin CLI in one image (CPU build).
#   docker build -t kvstash .
#   docker compose up        # redis + cache server + engine, see docker-compose.yml
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/kvstash

# The CPU wheel of torch first, from PyTorch's own index: the default index would
# pull a multi-GB CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.11"

COPY pyproject.toml README.md ./
COPY engine ./engine
COPY connector ./connector
COPY storage_backends ./storage_backends
COPY cache_server ./cache_server
COPY kernels ./kernels
COPY protos ./protos
RUN pip install .

# Run as an unprivileged user; /data holds the cache server's disk tier and models.
RUN useradd --create-home --uid 1000 kvstash && mkdir -p /data && chown kvstash /data
USER kvstash
VOLUME ["/data"]
EXPOSE 50051 8000

CMD ["kvstash", "--help"]
