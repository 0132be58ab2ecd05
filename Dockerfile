# fastpubsub images.
#   docker build -t fastpubsub:0.1.0 .                        the server: `docker run IMAGE` serves
#       the API; any other CLI command runs as `docker run IMAGE db-migrate`, `... cleanup-acked-messages`
#   docker build --target spark -t fastpubsub-spark:0.1.0 .  the same CLI with Java 17, PySpark and the
#       PostgreSQL JDBC driver, for `fastpubsub archive` and `fastpubsub report` (local[*] inside the
#       container, or --master for a cluster)

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fastpubsub ./fastpubsub
COPY migrations ./migrations
COPY spark ./spark
RUN python -m venv /opt/fastpubsub && /opt/fastpubsub/bin/pip install .

# Only built for --target spark.
FROM build AS build-spark
RUN /opt/fastpubsub/bin/pip install ".[spark]"

# What every image runs on: a fixed uid and gid (10001, outside any host's
# system range) that the Kubernetes manifests name in runAsUser and runAsGroup.
FROM python:3.11-slim AS runtime-slim
RUN groupadd --system --gid 10001 fastpubsub \
    && useradd --system --uid 10001 --gid 10001 --home-dir /app --shell /usr/sbin/nologin fastpubsub \
    && mkdir /app && chown fastpubsub:fastpubsub /app
ENV PATH=/opt/fastpubsub/bin:$PATH \
    PYTHONUNBUFFERED=1
WORKDIR /app

FROM runtime-slim AS spark
# Debian's Java 17 runtime and JDBC driver (/usr/share/java/postgresql.jar, which
# fastpubsub finds by itself). Spark writes its scratch files under /tmp and
# HOME: both are the writable /tmp volume in Kubernetes.
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless libpostgresql-jdbc-java \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build-spark /opt/fastpubsub /opt/fastpubsub
ENV HOME=/tmp
USER 10001:10001
ENTRYPOINT ["fastpubsub"]
CMD ["archive"]

FROM runtime-slim
COPY --from=build /opt/fastpubsub /opt/fastpubsub
ENV FASTPUBSUB_API_HOST=0.0.0.0 \
    FASTPUBSUB_API_PORT=8000
USER 10001:10001
EXPOSE 8000
# The check reads FASTPUBSUB_API_PORT at run time, so `-e FASTPUBSUB_API_PORT=9000`
# moves the server and its health check together.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request\ntry:\n    url = 'http://127.0.0.1:%s/liveness' % os.environ.get('FASTPUBSUB_API_PORT', '8000')\n    sys.exit(urllib.request.urlopen(url, timeout=2).status != 200)\nexcept OSError as exc:\n    sys.exit('unhealthy: %s' % exc)"]
ENTRYPOINT ["fastpubsub"]
CMD ["server"]
