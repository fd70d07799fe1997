# kvstash: the engine, the cache server and the admin CLI in one image (CPU build).
#   docker build -t kvstash .
#   docker compose up        # redis + cache server + engine, see docker-compose.yml
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/kvstash

# The locked packages (versions and file hashes of requirements/lock.txt), then the CPU
# wheel of torch at the version scripts/setup_env.sh pins, from PyTorch's own index: the
# default index would pull a multi-GB CUDA build.
COPY requirements/lock.txt ./requirements/lock.txt
RUN pip install --require-hashes --no-deps -r requirements/lock.txt \
 && pip install --no-deps --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0"

COPY pyproject.toml README.md ./
COPY engine ./engine
COPY connector ./connector
COPY storage_backends ./storage_backends
COPY cache_server ./cache_server
COPY kernels ./kernels
COPY protos ./protos
COPY bench ./bench
RUN pip install --no-deps --no-build-isolation . && pip check

# Run as an unprivileged user; /data holds the cache server's disk tier and models.
RUN useradd --create-home --uid 1000 kvstash && mkdir -p /data && chown kvstash /data
USER kvstash
VOLUME ["/data"]
EXPOSE 50051 8000

CMD ["kvstash", "--help"]
