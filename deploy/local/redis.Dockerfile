# Debian's redis-server on the Debian base image: docker-compose.local.yml's stand-in for
# the official redis image. The command (persistence, eviction) comes from the compose file.
ARG BASE=kvfleet-base:bookworm
FROM ${BASE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
CMD ["redis-server"]
