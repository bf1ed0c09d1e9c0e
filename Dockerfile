# syntax=docker/dockerfile:1
# Build:  docker build -t tollgate .
# Run:    docker run --rm -p 127.0.0.1:8080:8080 -p 127.0.0.1:9090:9090 \
#           -v "$PWD/config.toml:/etc/tollgate/config.toml:ro" \
#           -v "$PWD/users:/etc/tollgate/users:ro" tollgate
# The admin port reaches the container only if the mounted config says
# `[admin] listen = "0.0.0.0:9090"` (the shipped config.toml keeps it on 127.0.0.1,
# where only the HEALTHCHECK below reaches it). compose.yaml runs two replicas with Redis.
# In the container the proxy listens on 0.0.0.0:8080 (TOLLGATE_LISTEN) whatever the file
# says: set `[access] users = "/etc/tollgate/users"` in the mounted config (an htpasswd -B
# file) before publishing the port beyond the host, and `[access] allow` for any
# internal service the apps call.

FROM rust:1-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY .cargo ./.cargo
COPY src ./src
COPY benches ./benches
RUN cargo build --release --locked && cp target/release/tollgate /src/tollgate

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin tollgate
COPY --from=build /src/tollgate /usr/local/bin/tollgate
COPY config.toml /etc/tollgate/config.toml
# MIMALLOC_PURGE_DELAY=0: memory freed after a burst (10 000 waiting requests whose
# clients left) goes back to the kernel at once, not at the allocator's next busy moment
# (docs/operations.md, "Memory").
ENV TOLLGATE_CONFIG=/etc/tollgate/config.toml \
    TOLLGATE_LISTEN=0.0.0.0:8080 \
    MIMALLOC_PURGE_DELAY=0
USER tollgate
EXPOSE 8080 9090
# The image has no curl: the binary GETs its own admin /healthz (TOLLGATE_HEALTH_URL,
# default http://127.0.0.1:9090/healthz; the config needs an [admin] listener there).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
  CMD ["/usr/local/bin/tollgate", "health"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/tollgate"]
