#!/bin/sh
# Formats the log directory once (a fresh cluster id), then runs the broker in the
# foreground. Listeners from the environment: KAFKA_HOST, KAFKA_PORT, KAFKA_CONTROLLER_PORT.
set -eu
host="${KAFKA_HOST:-127.0.0.1}"; port="${KAFKA_PORT:-9092}"; ctl="${KAFKA_CONTROLLER_PORT:-9093}"
data=/var/lib/kafka/data
cat > /opt/kafka/server.properties <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@${host}:${ctl}
listeners=PLAINTEXT://${host}:${port},CONTROLLER://${host}:${ctl}
advertised.listeners=PLAINTEXT://${host}:${port}
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=${data}
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
log.retention.hours=168
PROPS
run() { java -Xmx768m -cp "/opt/kafka/libs/*" -Dlog4j2.configurationFile=/opt/kafka/log4j2.properties "$@"; }
if [ ! -f "$data/meta.properties" ]; then
  run kafka.tools.StorageTool format -t "$(run kafka.tools.StorageTool random-uuid)" \
      -c /opt/kafka/server.properties >/dev/null
fi
exec java -Xmx768m -cp "/opt/kafka/libs/*" -Dlog4j2.configurationFile=/opt/kafka/log4j2.properties \
     kafka.Kafka /opt/kafka/server.properties
