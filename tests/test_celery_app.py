"""The Celery app's delivery settings, decided deliberately (kvfleet/celery_app.py)."""

from __future__ import annotations

from kombu.transport import redis as kombu_redis

from kvfleet.broker import Channel, Transport
from kvfleet.celery_app import make_celery
from kvfleet.settings import Settings


def test_a_task_is_acknowledged_only_once_its_job_outcome_is_recorded():
    conf = make_celery(Settings.from_env({})).conf
    assert conf.task_acks_late  # after the run, not on receipt
    assert conf.task_reject_on_worker_lost  # a killed worker's task goes back
    # A task the infrastructure broke (it raised) is not acked away: it comes back.
    assert conf.task_acks_on_failure_or_timeout is False
    assert conf.worker_prefetch_multiplier == 1
    assert conf.accept_content == ["json"] and conf.task_serializer == "json"  # never pickle


def test_the_broker_channel_builds_one_redis_client_and_still_delivers_and_acks(redis_url, redis_client, prefix):
    """kvfleet/broker.py: kombu's channel no longer builds a redis-py client per operation;
    publishing, delivering and acknowledging through the real Redis still work, and after
    the channel drops its pool (as it does on close) the client follows the new pool."""
    settings = Settings.from_env({"KVFLEET_REDIS_URL": redis_url})
    app = make_celery(settings)
    assert make_celery(Settings.from_env({"KVFLEET_REDIS_URL": "sentinel://localhost:26379"})).conf.broker_transport \
        is None  # anything but redis:// and rediss:// keeps kombu's own transport
    queue = f"{prefix}.broker-test"
    with app.connection_for_write() as conn:
        assert isinstance(conn.transport, Transport)
        channel = conn.default_channel
        assert isinstance(channel, Channel)
        built = []
        real = kombu_redis.Channel._create_client

        def counting(self, asynchronous=False):
            built.append(asynchronous)
            return real(self, asynchronous)

        kombu_redis.Channel._create_client = counting
        try:
            simple = conn.SimpleQueue(queue)
            for i in range(3):
                simple.put({"n": i})
            got = []
            for _ in range(3):
                message = simple.get(timeout=5)
                got.append(message.payload["n"])
                message.ack()  # the unacked bookkeeping and its removal go through the shared client
            assert got == [0, 1, 2]
            assert built.count(False) <= 1, built  # one sync client for three publishes, gets and acks
            first = channel._create_client()
            assert channel._create_client() is first
            channel._pool = None  # what closing the channel does to its pools
            assert channel._create_client() is not first
            assert channel._create_client().connection_pool is channel.pool
            simple.close()
        finally:
            kombu_redis.Channel._create_client = real
            redis_client.delete(queue)
    # Nothing left unacknowledged in the transport's bookkeeping for this queue.
    unacked = redis_client.hgetall("unacked")
    assert not any(queue.encode() in v for v in unacked.values())
