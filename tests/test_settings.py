"""Unit: settings come from the environment and fail with a message naming the variable."""

from __future__ import annotations

import pytest

from kvfleet.settings import Settings, parse_api_keys


def test_defaults_and_overrides():
    s = Settings.from_env({"KVFLEET_TOPIC_PREFIX": "x.req", "KVFLEET_API_PORT": "9000", "KVFLEET_MAX_NUM_SEQS": "4"})
    assert s.kafka.topics == ["x.req.high", "x.req.normal", "x.req.low"] and s.kafka.dlq == "x.req.dlq"
    assert s.api.public_url == "http://127.0.0.1:9000"
    assert s.worker.max_num_seqs == 4
    assert Settings.from_env({}).model.source == "builtin:tiny"


@pytest.mark.parametrize("env,message", [
    ({"KVFLEET_API_PORT": "eighty"}, "KVFLEET_API_PORT='eighty' is not an integer"),
    ({"KVFLEET_MAX_NUM_SEQS": "0"}, "KVFLEET_MAX_NUM_SEQS=0 must be >= 1"),
    ({"KVFLEET_VISIBILITY_TIMEOUT_S": "-1"}, "KVFLEET_VISIBILITY_TIMEOUT_S=-1.0 must be > 0"),
    ({"KVFLEET_API_KEYS": "justakey"}, "must look like 'apikey:tenant'"),
])
def test_bad_values_name_the_variable(env, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Settings.from_env(env)


def test_an_api_key_maps_to_one_tenant():
    assert parse_api_keys("k1:acme, k2:globex") == {"k1": "acme", "k2": "globex"}
    with pytest.raises(ValueError, match="twice"):
        parse_api_keys("k1:acme,k1:globex")
