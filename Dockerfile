# syntax=docker/dockerfile:1
# Build:  docker build -t tollgate .
# Run:    docker run --rm -p 8080:8080 -v "$PWD/config.toml:/etc/tollgate/config.toml:ro" tollgate
# In the container the proxy listens on 0.0.0.0:8080 (TOLLGATE_LISTEN) whatever the file says.

# The Rust release is pinned: the profile-guided build (scripts/build-pgo) merges its
# profile with llvm-profdata of rustc's own LLVM (LLVM 22 for rustc 1.95, Debian's
# llvm-22, which the script installs), and a newer rustc may need an LLVM Debian lacks.
FROM rust:1.95-slim-bookworm AS build
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY .cargo ./.cargo
COPY src ./src
COPY benches ./benches
# The training workload of the profile-guided build, and the test upstreams it uses.
COPY examples ./examples
COPY tests ./tests
COPY scripts/build-pgo ./scripts/build-pgo
RUN scripts/build-pgo --out /src/tollgate

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin tollgate
COPY --from=build /src/tollgate /usr/local/bin/tollgate
COPY config.toml /etc/tollgate/config.toml
ENV TOLLGATE_CONFIG=/etc/tollgate/config.toml \
    TOLLGATE_LISTEN=0.0.0.0:8080
USER tollgate
EXPOSE 8080 9090
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/tollgate"]
