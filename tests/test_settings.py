"""Unit: settings come from the environment and fail with a message naming the variable."""

from __future__ import annotations

import pytest

from kvfleet.settings import Settings, parse_api_keys


def test_defaults_and_overrides():
    s = Settings.from_env({"KVFLEET_TOPIC_PREFIX": "x.req", "KVFLEET_API_PORT": "9000", "KVFLEET_MAX_NUM_SEQS": "4"})
    assert s.kafka.topics == ["x.req.high", "x.req.normal", "x.req.low"] and s.kafka.dlq == "x.req.dlq"
    assert s.api.base_url == "http://127.0.0.1:9000"
    assert s.engine.max_num_seqs == 4
    assert Settings.from_env({}) == Settings()  # every default stated once, in the field
    assert Settings.from_env({"KVFLEET_HIGH_SHARE": "0.5"}).policy.high.share == 0.5  # a class's knob
    assert Settings.from_env({"KVFLEET_TENANTS": "@/etc/t.json"}).tenants == "@/etc/t.json"


def test_every_setting_is_read_from_its_own_variable():
    import dataclasses

    def variables(obj, prefix=""):
        for f in dataclasses.fields(obj):
            if f.metadata.get("nested"):
                yield from variables(getattr(obj, f.name), prefix + f.metadata["prefix"])
            else:
                assert "env" in f.metadata, f"{type(obj).__name__}.{f.name} has no KVFLEET_ variable"
                yield f"KVFLEET_{prefix}{f.metadata['env']}"

    names = list(variables(Settings()))
    assert len(names) == len(set(names)), "two settings read the same variable"


@pytest.mark.parametrize("env,message", [
    ({"KVFLEET_API_PORT": "eighty"}, "KVFLEET_API_PORT='eighty' is not an integer"),
    ({"KVFLEET_MAX_NUM_SEQS": "0"}, "KVFLEET_MAX_NUM_SEQS=0 must be >= 1"),
    ({"KVFLEET_VISIBILITY_TIMEOUT_S": "-1"}, "KVFLEET_VISIBILITY_TIMEOUT_S=-1.0 must be > 0"),
    ({"KVFLEET_API_KEYS": "justakey"}, "must look like 'apikey:tenant'"),
    ({"KVFLEET_KERNELS": "cuda"}, "KVFLEET_KERNELS='cuda' must be one of auto, triton, native, torch"),
    ({"KVFLEET_COLD_TIER": "maybe"}, "KVFLEET_COLD_TIER='maybe' is not a boolean"),
])
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Settings.from_env(env)


def test_an_api_key_maps_to_one_tenant():
    assert parse_api_keys("k1:acme, k2:globex") == {"k1": "acme", "k2": "globex"}
    with pytest.raises(ValueError, match="twice"):
        parse_api_keys("k1:acme,k1:globex")


def test_kafka_security_reaches_every_client_option():
    plain = Settings.from_env({}).kafka.client_options
    assert plain == {"bootstrap_servers": "127.0.0.1:19092", "security_protocol": "PLAINTEXT"}
    sasl = Settings.from_env({"KVFLEET_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVFLEET_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
                              "KVFLEET_KAFKA_SASL_USERNAME": "kvfleet", "KVFLEET_KAFKA_SASL_PASSWORD": "s3cret",
                              "KVFLEET_KAFKA_SSL_CAFILE": "/etc/kafka/ca.pem"}).kafka.client_options
    assert sasl["sasl_mechanism"] == "SCRAM-SHA-512" and sasl["sasl_plain_username"] == "kvfleet"
    assert sasl["sasl_plain_password"] == "s3cret" and sasl["ssl_cafile"] == "/etc/kafka/ca.pem"
    with pytest.raises(ValueError, match="KVFLEET_KAFKA_SASL_USERNAME"):
        Settings.from_env({"KVFLEET_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"})
    # The clients take these options as they are (kafka-python would refuse an unknown one).
    from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

    for client in (KafkaProducer, KafkaConsumer, KafkaAdminClient):
        assert set(sasl) <= set(client.DEFAULT_CONFIG), (client, set(sasl) - set(client.DEFAULT_CONFIG))
    # The API's librdkafka producer gets the same, in librdkafka's names; librdkafka
    # refuses a name it does not know when the producer is made.
    import confluent_kafka

    rd = Settings.from_env({"KVFLEET_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVFLEET_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
                            "KVFLEET_KAFKA_SASL_USERNAME": "kvfleet", "KVFLEET_KAFKA_SASL_PASSWORD": "s3cret",
                            "KVFLEET_KAFKA_SSL_CAFILE": "/etc/kafka/ca.pem", "KVFLEET_KAFKA_SSL_CERTFILE": "/etc/c.pem",
                            "KVFLEET_KAFKA_SSL_KEYFILE": "/etc/k.pem"}).kafka.rdkafka_options
    assert rd == {"bootstrap.servers": "127.0.0.1:19092", "security.protocol": "SASL_SSL",
                  "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "kvfleet", "sasl.password": "s3cret",
                  "ssl.ca.location": "/etc/kafka/ca.pem", "ssl.certificate.location": "/etc/c.pem",
                  "ssl.key.location": "/etc/k.pem"}
    confluent_kafka.Producer({k: v for k, v in rd.items() if not k.startswith("ssl.")})  # files that do not exist
    with pytest.raises(confluent_kafka.KafkaException):
        confluent_kafka.Producer({"bootstrap.servers": "x", "sasl.user": "typo"})


def test_worker_threads_fill_the_engine_and_keep_the_high_reserve_free():
    s = Settings.from_env({})
    assert s.engine.max_num_seqs == 64 and s.policy.high_slot_reserve == 0.25
    assert s.worker_concurrency == 256  # three batches of 64 for normal and low, a quarter of the 256 for high
    threads = s.worker_concurrency
    assert threads - int(s.policy.high_slot_reserve * threads) >= 3 * s.engine.max_num_seqs
    assert Settings.from_env({"KVFLEET_HIGH_SLOT_RESERVE": "0"}).worker_concurrency == 3 * 64
    assert Settings.from_env({"KVFLEET_MAX_NUM_SEQS": "8"}).worker_concurrency == 32
    assert Settings.from_env({"KVFLEET_WORKER_CONCURRENCY": "16"}).worker_concurrency == 16


def test_a_worker_gives_torch_one_thread_unless_told_otherwise():
    from workers.service import torch_threads

    assert torch_threads(Settings.from_env({}), env={}) == 1
    assert torch_threads(Settings.from_env({}), env={"OMP_NUM_THREADS": "4"}) == 4  # the convention, if set
    assert torch_threads(Settings.from_env({}), env={"OMP_NUM_THREADS": "lots"}) == 1
    assert torch_threads(Settings.from_env({"KVFLEET_WORKER_TORCH_THREADS": "3"}), env={"OMP_NUM_THREADS": "4"}) == 3
