# pylon in a container. Built by no CI job (no Docker engine there); tests/unit/test_container_files.py
# checks that every file it copies and every command it runs exists and parses.
#
#   docker build -t pylon .                      # the runtime image (the last stage)
#   docker build --target dynamo -t pylon-dynamo .   # + real NVIDIA Dynamo 1.6.1 (compose profile `dynamo`)

# --- base: pylon and its runtime dependencies only, as an unprivileged user ---
FROM python:3.11-slim AS base
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pylon ./pylon
COPY mock_dynamo ./mock_dynamo
COPY router_ffi ./router_ffi
# The otel extra: --otel-endpoint works in the image (pylon refuses to start without it).
RUN pip install '.[otel]' && useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin pylon

# --- dynamo: + the Dynamo 1.6.1 frontend and mocker, and the loopback stack launcher ---
# ai-dynamo goes in with --no-deps: its aisimulate dependency downloads from NVIDIA's own index
# at build time (see scripts/install_dynamo.sh); the frontend and mocker do not import it.
FROM base AS dynamo
RUN pip install '.[dynamo]' && pip install --no-deps 'ai-dynamo==1.6.1'
COPY scripts/dynamo_stack.py ./scripts/dynamo_stack.py
USER pylon
ENV HOME=/tmp
ENTRYPOINT ["python", "scripts/dynamo_stack.py"]

# --- runtime (the default target) ---
FROM base AS runtime
# Inside the container pylon listens on all interfaces; compose publishes the port to the node's
# loopback only.
ENV PYLON_LISTEN=0.0.0.0:8080
EXPOSE 8080
USER pylon
ENTRYPOINT ["pylon"]
CMD ["serve"]
