"""The C decode kernel (kernels/native.py, kernels/csrc/paged_decode.c) against the
reference, its build, and an engine that runs it."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from kernels import native, ops, reference, torch_attention
from tests.test_kernels import MIXED, make_batch, max_err

pytestmark = pytest.mark.skipif(native.library() is None, reason="no C compiler to build the native kernel")

CTXS = [1, 3, 4, 5, 15, 16, 17, 100, 255, 257]


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (4, 4, 32), (6, 2, 32), (12, 4, 16), (3, 1, 48), (2, 1, 20)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_matches_reference(hq, hkv, d, block_size) -> None:
    # Shuffled blocks, NaN in every unused slot (a read past a context would show), four
    # query heads per group (the vector path) and other group sizes and head dims (the
    # scalar rest: 3 and 1 rows, D of 20 and 48).
    q, kc, vc, paged = make_batch([1] * len(CTXS), CTXS, hq, hkv, d, torch.float32, block_size=block_size)
    want = reference.paged_attention(q, kc, vc, paged, d**-0.5)
    got = native.decode(q, kc, vc, paged, d**-0.5)
    assert got is not None and got.shape == q.shape and got.dtype == torch.float32
    assert max_err(got, want) <= 1e-5


def test_paged_attention_sends_all_but_fp32_decode_to_torch() -> None:
    q, kc, vc, paged = make_batch(*MIXED, 4, 2, 16, torch.float32)  # prefill rows beside decodes
    want = reference.paged_attention(q, kc, vc, paged, 0.25)
    assert max_err(native.paged_attention(q, kc, vc, paged, 0.25), want) <= 1e-5
    q, kc, vc, paged = make_batch([1] * 4, [1, 5, 16, 33], 8, 2, 32, torch.bfloat16, block_size=16)
    assert native.decode(q, kc, vc, paged, 32**-0.5) is None  # not fp32: the torch path's
    got = native.paged_attention(q, kc, vc, paged, 32**-0.5)
    assert torch.equal(got, torch_attention.paged_attention(q, kc, vc, paged, 32**-0.5))


def test_loading_the_kernel_leaves_the_process_floating_point_alone() -> None:
    # A library linked with -ffast-math turns on flush-to-zero for the whole process
    # when it loads: subnormals would then read as 0 in every float op, Python's too.
    native.load(native.build())
    assert 5e-324 * 1.0 == 5e-324
    assert torch.tensor(1e-40, dtype=torch.float32).mul(1.0).item() != 0.0


def test_a_batch_outside_the_pool_is_refused_not_read() -> None:
    q, kc, vc, paged = make_batch([1, 1], [5, 9], 4, 2, 16, torch.float32)
    bad = paged.block_tables.clone()
    bad[1, 0] = kc.shape[0]  # one past the pool
    with pytest.raises(ValueError, match="out of bounds"):
        native.decode(q, kc, vc, type(paged)(paged.cu_seqlens_q, paged.context_lens, bad), 0.25)
    long_ctx = paged.context_lens.clone()
    long_ctx[0] = paged.block_tables.shape[1] * kc.shape[1] + 1  # more tokens than the table has blocks for
    with pytest.raises(ValueError, match="out of bounds"):
        native.decode(q, kc, vc, type(paged)(paged.cu_seqlens_q, long_ctx, paged.block_tables), 0.25)


def test_select_auto_on_a_cpu_runs_native() -> None:
    kernels = ops.select("auto", "paged")
    if kernels.backend != "triton":  # TRITON_INTERPRET=1 runs Triton on the CPU instead
        assert (kernels.backend, kernels.paged_attention) == ("native", native.paged_attention)
    assert ops.select("native", "paged").paged_attention is native.paged_attention
    assert ops.select("torch", "paged").paged_attention is torch_attention.paged_attention


def test_build_is_cached_and_named_by_its_source(tmp_path) -> None:
    path = native.build(tmp_path)
    assert path.parent == tmp_path and path.name.startswith("paged_decode-") and path.suffix == ".so"
    built = path.stat().st_mtime_ns
    assert native.build(tmp_path) == path and path.stat().st_mtime_ns == built  # not built again
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    native.load(path)  # loads, and has the function


def test_a_missing_compiler_names_the_fix(tmp_path, monkeypatch) -> None:
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: no such compiler' >&2\nexit 1\n")
    broken.chmod(broken.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(broken))
    monkeypatch.setenv("KVFLEET_HOME", str(tmp_path / "home"))
    with pytest.raises(RuntimeError, match="no such compiler"):
        native.build()
    with pytest.raises(ValueError, match="backend 'native' cannot run here"):
        ops.select("native", "paged")
    assert not any(name.endswith(".tmp") for _, _, files in os.walk(tmp_path / "home") for name in files)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    with pytest.raises(RuntimeError, match="KVFLEET_KERNELS=torch"):
        native.build(tmp_path / "other")


def test_an_engine_on_native_kernels_generates_what_torch_does() -> None:
    from workers.engine import Engine, EngineConfig
    from workers.model import load_model

    model = load_model("builtin:bench", device="cpu")
    prompts = [list(range(1 + i, 40 + 7 * i)) for i in range(5)]  # prompts past a block, decoding across blocks
    outputs = {}
    for backend in ("native", "torch"):
        with Engine(model, EngineConfig(kernels=backend)) as engine:
            assert engine.kernels.backend == backend
            handles = [engine.submit(f"r{i}", p, 40, ignore_eos=True) for i, p in enumerate(prompts)]
            outputs[backend] = [h.result(60).tokens for h in handles]
    assert outputs["native"] == outputs["torch"]
