# Apache Kafka (KRaft, one node) from the Maven Central jars, as `kvfleet infra up`
# runs it, on the Debian base image: docker-compose.local.yml's stand-in for the
# official apache/kafka image where no image registry can be reached.
ARG BASE=kvfleet-base:bookworm
FROM ${BASE}
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      openjdk-17-jre-headless maven ca-certificates && rm -rf /var/lib/apt/lists/*
# The same pom the development scripts use: the same broker version and dependencies.
COPY kvfleet/infra/pom.xml kvfleet/infra/log4j2.properties /opt/kafka/
RUN mvn -q -B -f /opt/kafka/pom.xml dependency:copy-dependencies -DoutputDirectory=/opt/kafka/libs \
      -DincludeScope=runtime && rm -rf /root/.m2
COPY deploy/local/kafka-start.sh /opt/kafka/kafka-start.sh
VOLUME /var/lib/kafka/data
CMD ["/opt/kafka/kafka-start.sh"]
