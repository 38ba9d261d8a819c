# syntax=docker/dockerfile:1
# lmqtt images, built from this repository only (see .dockerignore: an allow-list).
#
#   docker build --target gateway   -t lmqtt .            # gateway + device simulator (~80 MB)
#   docker build --target analytics -t lmqtt-analytics .  # + JRE and PySpark for `lmqtt report`
#
# Both run as the non-root user `lmqtt` (uid LMQTT_UID, default 1000 so that a ./reports folder
# created by the usual first user on the host is writable) with `lmqtt` as the entrypoint.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- wheels: build the project's wheel once, from the repository's sources -------------------
FROM ${PYTHON_IMAGE} AS wheels
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# A C compiler for the optional accelerators (the C kernels, and the modules mypyc compiles:
# accelerators/compiled.py); only this stage has it, the runtime image gets the compiled wheel.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml setup.py README.md ./
COPY gateway ./gateway
COPY store ./store
COPY topicmap ./topicmap
COPY analytics ./analytics
COPY rocketmq_remoting ./rocketmq_remoting
COPY accelerators ./accelerators
COPY sim ./sim
RUN pip wheel --no-deps --wheel-dir /wheels .

# --- runtime: python, the lmqtt user, the data and reports folders ----------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG LMQTT_UID=1000
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid "${LMQTT_UID}" --user-group lmqtt \
 && install -d -o lmqtt -g lmqtt /data /reports

# --- analytics: `lmqtt report` needs a JRE for Spark ------------------------------------------
FROM runtime AS analytics
# (slim images have no man directories, which the JRE's postinst expects; procps: Spark's scripts)
RUN mkdir -p /usr/share/man/man1 \
 && apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
 && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install "$(echo /wheels/lmqtt-*.whl)[sim,analytics]"
# pip's PySpark is a complete Spark: `spark-class` (the cluster profile's master and worker)
# finds its jars through SPARK_HOME.
ENV SPARK_HOME=/usr/local/lib/python3.11/site-packages/pyspark
USER lmqtt
WORKDIR /home/lmqtt
ENTRYPOINT ["lmqtt"]
CMD ["report", "--help"]

# --- gateway (the default target): `lmqtt serve` and `lmqtt sim` ------------------------------
FROM runtime AS gateway
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install "$(echo /wheels/lmqtt-*.whl)[sim]"
# The gateway listens on loopback by default (like Mosquitto 2); in a container it must not.
ENV LMQTT_HOST=0.0.0.0 \
    LMQTT_DATA_DIR=/data
USER lmqtt
WORKDIR /home/lmqtt
VOLUME ["/data"]
EXPOSE 1883
ENTRYPOINT ["lmqtt"]
CMD ["serve"]
