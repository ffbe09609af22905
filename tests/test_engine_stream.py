"""The engine's streaming hooks: `Sampling.stop_token_ids` end a request like EOS, and
`on_token` sees every generated token, in order, before the result resolves."""

from __future__ import annotations

import pytest
import torch

from kvfleet.contracts import Sampling
from workers.engine import Engine, EngineConfig
from workers.model import LoadedModel, load_model

torch.set_num_threads(1)
SAMPLING = Sampling(temperature=1.0, seed=7)
PROMPT = [256, *b"stream me"]


@pytest.fixture(scope="module")
def engine():
    loaded: LoadedModel = load_model("builtin:tiny", device="cpu", dtype="float32")
    with Engine(loaded, EngineConfig(num_blocks=64)) as engine:
        yield engine


def test_a_stop_token_ends_the_request_and_is_not_in_the_text(engine):
    free = engine.generate("free", PROMPT, 40, SAMPLING, ignore_eos=True)
    # A token that first appears a few tokens in: the request must end right there.
    k, stop_token = next((i, t) for i, t in enumerate(free.tokens) if i >= 3 and t not in free.tokens[:i])
    sampling = Sampling(temperature=1.0, seed=7, stop_token_ids=[stop_token])
    stopped = engine.generate("stopped", PROMPT, 40, sampling, ignore_eos=True)
    tok = engine.loaded.tokenizer
    assert stopped.tokens == free.tokens[:k + 1]  # the stop token stays in the tokens, like EOS
    assert stopped.finish_reason == "stop"
    assert stopped.text == tok.decode(free.tokens[:k])


def test_on_token_sees_every_token_in_order_before_the_result(engine):
    seen: list[int] = []
    handle = engine.submit("told", PROMPT, 30, SAMPLING, on_token=seen.append)
    result = handle.result(timeout=60)
    assert seen and seen == result.tokens


def test_a_failing_on_token_costs_nothing_but_its_own_calls(engine):
    def boom(token: int) -> None:
        raise RuntimeError("callback bug")

    together = [engine.submit("bad", PROMPT, 12, SAMPLING, on_token=boom),
                engine.submit("good", PROMPT, 12, SAMPLING)]
    bad, good = (h.result(timeout=60) for h in together)
    assert bad.tokens == good.tokens
