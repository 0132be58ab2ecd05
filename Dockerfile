# fastpubsub server image: `docker run IMAGE` serves the API; any other CLI
# command runs as `docker run IMAGE db-migrate`, `... cleanup-acked-messages`, etc.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fastpubsub ./fastpubsub
COPY migrations ./migrations
COPY spark ./spark
RUN python -m venv /opt/fastpubsub && /opt/fastpubsub/bin/pip install .

FROM python:3.11-slim
# A fixed uid and gid (10001, outside any host's system range) that the
# Kubernetes manifests name in runAsUser and runAsGroup.
RUN groupadd --system --gid 10001 fastpubsub \
    && useradd --system --uid 10001 --gid 10001 --home-dir /app --shell /usr/sbin/nologin fastpubsub \
    && mkdir /app && chown fastpubsub:fastpubsub /app
COPY --from=build /opt/fastpubsub /opt/fastpubsub
ENV PATH=/opt/fastpubsub/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    FASTPUBSUB_API_HOST=0.0.0.0 \
    FASTPUBSUB_API_PORT=8000
USER 10001:10001
WORKDIR /app
EXPOSE 8000
# The check reads FASTPUBSUB_API_PORT at run time, so `-e FASTPUBSUB_API_PORT=9000`
# moves the server and its health check together.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request\ntry:\n    url = 'http://127.0.0.1:%s/liveness' % os.environ.get('FASTPUBSUB_API_PORT', '8000')\n    sys.exit(urllib.request.urlopen(url, timeout=2).status != 200)\nexcept OSError as exc:\n    sys.exit('unhealthy: %s' % exc)"]
ENTRYPOINT ["fastpubsub"]
CMD ["server"]
