# An S3 endpoint for tests/compose_live: moto's server (the S3 the other tests use), built from the
# same base image as docker/Dockerfile, for machines that cannot pull minio/minio. Only
# tests/compose_live/docker-compose.moto.yml builds it; docker-compose.yml keeps MinIO for users.
# Build arguments as docker/Dockerfile's (PYTHON_IMAGE, BUILD_EXTRAS). moto and its server's
# dependencies at the dev lock's versions.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE}
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PATH=/opt/venv/bin:$PATH
ARG BUILD_EXTRAS=docker/local
COPY ${BUILD_EXTRAS}/ /opt/build-extras/
RUN if [ -s /opt/build-extras/ca-certificates.crt ]; then \
        cp /opt/build-extras/ca-certificates.crt /usr/local/share/ca-certificates/build-extras.crt \
        && update-ca-certificates >/dev/null; \
    fi \
 && rm -rf /opt/build-extras \
 && python -m venv /opt/venv
COPY requirements.lock requirements-dev.lock /tmp/locks/
RUN grep -hv '^-r' /tmp/locks/requirements.lock /tmp/locks/requirements-dev.lock \
        > /tmp/locks/constraints.txt \
 && pip install --constraint /tmp/locks/constraints.txt "moto[server]" boto3 \
 && rm -rf /tmp/locks
EXPOSE 9000
CMD ["moto_server", "-H", "0.0.0.0", "-p", "9000"]
