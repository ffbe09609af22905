"""bench/kernels.py's baselines (bench/attention_baselines.py) against the reference on
small CPU shapes, its rows and keys, and the memory ceiling (bench/bandwidth.py).

The GPU figures come from `python bench/kernels.py` on a GPU; here the same code runs in
fp32 on the CPU: SDPA's CPU backends, flex_attention eager (and compiled once).
"""

from __future__ import annotations

import functools
import json
import sys
import warnings

import pytest
import torch

from bench import attention_baselines as baselines
from bench import kernels as bk
from bench.bandwidth import Ceiling, ceiling, spec_peak_gbps
from kernels import reference
from kernels.contract import PagedBatch

TOL = 1e-5  # fp32 against the fp32 reference

DECODE = bk.Shape("decode", 3, 1, 37)  # a context that ends inside a page
PREFILL = bk.Shape("prefill", 2, 8, 40)  # 8 new tokens over a 32-token cached prefix
FULL_PREFILL = bk.Shape("prefill", 2, 24, 24)  # no cached prefix: q_len == context


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # flex's eager path warns that it is unfused
        warnings.simplefilter("ignore", UserWarning)
        yield


def _agree(prep: baselines.Prepared, args: tuple) -> None:
    want = reference.paged_attention(*args)
    assert prep.candidates, prep.skipped
    for name, c in prep.candidates.items():
        with c.scope():
            got = c.call()
        assert got.shape == want.shape, name
        assert (got - want).abs().max().item() <= TOL, name


@pytest.mark.parametrize("shape", [DECODE, PREFILL, FULL_PREFILL], ids=lambda s: f"{s.kind}-q{s.q_len}-ctx{s.context}")
def test_sdpa_contiguous_every_variant_agrees(shape):
    args = bk.make_inputs(shape, torch.float32, "cpu")
    prep = baselines.sdpa_contiguous(*args)
    _agree(prep, args)
    if shape.q_len == 1:
        assert {"flash", "math"} <= set(prep.candidates)  # the CPU's SDPA backends
    else:
        assert set(prep.candidates) == {"gqa", "heads-repeated"}


def test_sdpa_contiguous_needs_equal_contexts():
    q, k, v, batch, scale = bk.make_inputs(DECODE, torch.float32, "cpu")
    ragged = PagedBatch(batch.cu_seqlens_q, torch.tensor([37, 20, 37], dtype=torch.int32), batch.block_tables)
    with pytest.raises(ValueError, match="context lengths differ"):
        baselines.sdpa_contiguous(q, k, v, ragged, scale)


@pytest.mark.parametrize("shape", [DECODE, PREFILL, FULL_PREFILL], ids=lambda s: f"{s.kind}-q{s.q_len}-ctx{s.context}")
def test_flex_paged_agrees(shape):
    args = bk.make_inputs(shape, torch.float32, "cpu")
    _agree(baselines.flex_paged(*args, compiled=False), args)


def test_flex_paged_ragged_contexts_ignore_stale_table_entries():
    """The mask carries each sequence's own context; a table entry past a sequence's
    context that names another sequence's page must not count."""
    q, k, v, batch, scale = bk.make_inputs(bk.Shape("decode", 2, 1, 40), torch.float32, "cpu")
    tables = batch.block_tables.clone()  # (2, 3)
    tables[1, 2] = tables[0, 0]  # sequence 1 holds 20 tokens: 2 pages; its 3rd entry is stale
    ragged = PagedBatch(batch.cu_seqlens_q, torch.tensor([40, 20], dtype=torch.int32), tables)
    p2l = baselines.physical_to_logical(ragged, k.shape[0], k.shape[1])
    assert p2l[1, tables[0, 0]] == -1 and p2l[0, tables[0, 0]] == 0
    _agree(baselines.flex_paged(q, k, v, ragged, scale, compiled=False), (q, k, v, ragged, scale))


def test_flex_paged_compiled():
    """torch.compile(flex_attention) on the CPU (about 20 s the first time on this machine,
    a second or two from inductor's cache), as the bench runs it."""
    args = bk.make_inputs(bk.Shape("decode", 2, 1, 40), torch.float32, "cpu")
    _agree(baselines.flex_paged(*args), args)


def test_bench_rows_for_every_baseline_without_errors():
    rows = bk.bench_attention(False, True, bk.timer(False, True), shape_list=[DECODE, PREFILL], flex_compiled=False)
    for kind in ("attention/decode", "attention/prefill"):
        impls = {r.impl: r for r in rows if r.op == kind}
        assert set(impls) == {"reference", "gather+sdpa", "sdpa-contig", "flex-paged"}
    assert [r for r in rows if r.error] == []
    assert all(r.gbps > 0 and r.max_err <= TOL for r in rows)
    sdpa = next(r for r in rows if r.impl == "sdpa-contig" and r.op == "attention/decode")
    assert "ran: " in sdpa.note and "gathered outside the timed call" in sdpa.note


def test_fractions_of_peak_and_the_headline_key():
    rows = [bk.Row("attention/decode", "B=64 q=1 ctx=4096", "triton", ms=1.0, gbps=3600.0),
            bk.Row("attention/decode", "B=64 q=1 ctx=4096", "sdpa-contig", ms=1.0, gbps=2400.0),
            bk.Row("attention/decode", "B=8 q=1 ctx=4096", "triton", ms=1.0, gbps=480.0),
            bk.Row("attention/decode", "B=64 q=1 ctx=4096", "flex-paged", error="no flex_attention")]
    summary = bk.add_fractions(rows, Ceiling(4800.0, "NVIDIA H200 HBM spec sheet", 4100.0))
    assert [r.fraction_of_peak for r in rows] == [0.75, 0.5, 0.1, None]
    assert summary["triton_decode_b64_ctx4k_fraction_of_peak"] == 0.75
    assert summary["decode_b64_ctx4k_fraction_of_peak"] == {"triton": 0.75, "sdpa-contig": 0.5}
    assert summary["target_fraction_of_peak"] == 0.8
    # A CPU run has no Triton row: the key is there, and null.
    assert bk.add_fractions(rows[1:2], Ceiling(20.0, "copy", 20.0))["triton_decode_b64_ctx4k_fraction_of_peak"] is None


def test_spec_peaks_by_device_name():
    assert spec_peak_gbps("NVIDIA H200") == 4800.0
    assert spec_peak_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert spec_peak_gbps("NVIDIA H100 PCIe") == 2000.0
    assert spec_peak_gbps("NVIDIA A100-SXM4-80GB") == 2000.0
    assert spec_peak_gbps("NVIDIA A100 80GB PCIe") == 2000.0
    assert spec_peak_gbps("NVIDIA A100-SXM4-40GB") == 1555.0
    assert spec_peak_gbps("NVIDIA L4") is None


def test_the_cpu_ceiling_is_a_measured_copy():
    one_ms = lambda fn: (fn(), 1.0)[1]  # noqa: E731 - every call "takes" 1 ms
    c = ceiling("CPU (x86_64)", False, one_ms)
    assert c.peak_gbps == c.copy_gbps == pytest.approx(2 * (256 << 20) / 1e6)  # read + write of 256 MiB in 1 ms
    assert "copy measured in this run" in c.source


def test_main_writes_the_keys_and_rows(tmp_path, monkeypatch):
    """The --quick path on the CPU, on two small shapes (flex eager: no compile wait)."""
    monkeypatch.setattr(bk, "shapes", lambda cuda, quick: [DECODE, PREFILL])
    monkeypatch.setattr(bk.baselines, "flex_paged", functools.partial(baselines.flex_paged, compiled=False))
    monkeypatch.setattr(sys, "argv", ["kernels.py", "--quick", "--out", str(tmp_path)])
    assert bk.main() == 0
    out = json.loads((tmp_path / "kernels.json").read_text())
    assert out["failed"] == 0 and out["peak_gbps"] > 0 and "copy measured" in out["peak_source"]
    assert out["triton_decode_b64_ctx4k_fraction_of_peak"] is None  # no Triton on the CPU
    impls = {r["impl"] for r in out["rows"]}
    assert impls == {"reference", "gather+sdpa", "sdpa-contig", "flex-paged"}
    assert all(r["fraction_of_peak"] == pytest.approx(r["gbps"] / out["peak_gbps"]) for r in out["rows"])
