# pylon in a container. Not built in CI (no Docker engine on the CI machines); kept simple.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pylon ./pylon
COPY mock_dynamo ./mock_dynamo
COPY router_ffi ./router_ffi
RUN pip install --no-cache-dir .
# Listen on all interfaces inside the container; publish the port to the node's loopback only.
ENV PYLON_LISTEN=0.0.0.0:8080
EXPOSE 8080
USER nobody
ENTRYPOINT ["pylon"]
CMD ["serve"]
