"""The real Apache Kafka 4.x broker, run locally in KRaft mode on one node.

Jars come from Maven Central through the pom beside this file (fetched once into
`$KVFLEET_HOME/kafka-<version>/libs`); the log directory is formatted once and kept,
so topics and committed offsets survive a restart (durable, like production).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from importlib import resources
from pathlib import Path

from kvfleet.infra import procs

HOST = "127.0.0.1"
PORT = 19092
CONTROLLER_PORT = 19093
HEAP = "-Xmx768m"  # plenty for a one-node dev broker; keeps the 24 GiB machine free for models


def _pom() -> Path:
    return Path(str(resources.files("kvfleet.infra") / "pom.xml"))


def version() -> str:
    match = re.search(r"<kafka.version>([^<]+)</kafka.version>", _pom().read_text())
    assert match, "kvfleet/infra/pom.xml lost its <kafka.version>"
    return match.group(1)


def base_dir() -> Path:
    return procs.home() / f"kafka-{version()}"


def libs_dir() -> Path:
    return base_dir() / "libs"


def data_dir() -> Path:
    return base_dir() / "data"


def pidfile() -> Path:
    return base_dir() / "broker.pid"


def logfile() -> Path:
    return base_dir() / "broker.log"


def ensure_jars() -> Path:
    """Fetch the broker and its runtime dependencies with Maven, once."""
    libs = libs_dir()
    marker = libs / ".complete"
    if marker.exists():
        return libs
    if shutil.which("mvn") is None or shutil.which("java") is None:
        raise RuntimeError("Kafka needs `java` (17+) and `mvn` on PATH: apt-get install -y openjdk-17-jre-headless maven")
    print(f"fetching Apache Kafka {version()} jars from Maven Central into {libs} ...", flush=True)
    libs.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mvn", "-q", "-B", "-f", str(_pom()), "dependency:copy-dependencies",
         f"-DoutputDirectory={libs}", "-DincludeScope=runtime"],
        check=True,
    )
    marker.write_text(version())
    return libs


def _server_properties() -> Path:
    props = base_dir() / "server.properties"
    props.write_text(
        "\n".join([
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@{HOST}:{CONTROLLER_PORT}",
            f"listeners=PLAINTEXT://{HOST}:{PORT},CONTROLLER://{HOST}:{CONTROLLER_PORT}",
            f"advertised.listeners=PLAINTEXT://{HOST}:{PORT}",
            "controller.listener.names=CONTROLLER",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name=PLAINTEXT",
            f"log.dirs={data_dir()}",
            # One node: internal topics cannot be replicated.
            "offsets.topic.replication.factor=1",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            # A fresh consumer group starts at once instead of waiting 3 s for members.
            "group.initial.rebalance.delay.ms=0",
            # kvfleet creates its topics explicitly with the partitions it needs.
            "auto.create.topics.enable=false",
            # Durability: the log is flushed by the OS; acks=all on one node means the
            # leader wrote it. Retention of a week is plenty for request topics.
            "log.retention.hours=168",
            "",
        ])
    )
    return props


def _java(main: str, *args: str) -> list[str]:
    log4j = resources.files("kvfleet.infra") / "log4j2.properties"
    return ["java", HEAP, "-cp", f"{libs_dir()}/*", f"-Dlog4j2.configurationFile={log4j}", main, *args]


def _ensure_formatted(props: Path) -> None:
    if (data_dir() / "meta.properties").exists():
        return
    cluster_id = base_dir() / "cluster.id"
    if not cluster_id.exists():
        # A Kafka cluster id is a base64url-encoded UUID (22 chars), like `random-uuid`.
        import base64

        # Never one that starts with "-": StorageTool would read it as an option (1 in 64).
        new_id = "-"
        while new_id.startswith("-"):
            new_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        cluster_id.write_text(new_id)
    subprocess.run(
        _java("kafka.tools.StorageTool", "format", "-t", cluster_id.read_text().strip(), "-c", str(props)),
        check=True, stdout=subprocess.DEVNULL,
    )


def running() -> bool:
    return procs.read_pid(pidfile()) is not None and procs.port_open(HOST, PORT)


def start(timeout: float = 90.0) -> str:
    """Start the broker if it is not running; return its bootstrap address."""
    bootstrap = f"{HOST}:{PORT}"
    if running():
        return bootstrap
    if procs.port_open(HOST, PORT):
        raise RuntimeError(f"port {PORT} is taken by another process; stop it or free the port for Kafka")
    ensure_jars()
    props = _server_properties()
    _ensure_formatted(props)
    with open(logfile(), "ab") as log:
        proc = subprocess.Popen(
            _java("kafka.Kafka", str(props)), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,  # outlives the starting shell
        )
    pidfile().write_text(str(proc.pid))
    procs.wait_until(lambda: answers(bootstrap) or proc.poll() is not None, timeout, f"Kafka at {bootstrap}", log=logfile())
    if proc.poll() is not None:
        raise RuntimeError(f"Kafka exited with {proc.returncode}; see {logfile()}")
    print(f"kafka {version()} up at {bootstrap} (pid {proc.pid}, log {logfile()})", flush=True)
    return bootstrap


def answers(bootstrap: str) -> bool:
    """True once the broker at `bootstrap` (host:port) serves metadata (the port opens a
    little earlier). bench/chaos.py probes its own broker with it too."""
    host, _, port = bootstrap.rpartition(":")
    if not procs.port_open(host, int(port)):
        return False
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000, client_id="kvfleet-probe")
    except (KafkaError, OSError, ValueError):
        return False
    try:
        admin.list_topics()
        return True
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()


def stop() -> bool:
    return procs.stop_pid(pidfile(), "kafka", timeout=60.0)
