"""The model layer against Hugging Face transformers: same logits, same greedy tokens.

A tiny random Llama (GQA, 2 layers) is saved with `save_pretrained` next to a
word-level tokenizer.json, loaded back with `load_model(path)`, and compared with
transformers' own forward and generate(), in float32 on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers

from kvfleet.contracts import Sampling
from workers.engine import Engine, EngineConfig
from kvfleet.modelconfig import LlamaConfig
from kvfleet.modelinfo import load_model_info
from kvfleet.tokenizer import ByteTokenizer
from workers.model import load_model
from kernels import ops
from kernels.contract import PagedBatch
from workers.model.attention import AttentionMetadata
from workers.model.loader import LoadedModel
from workers.model.sampling import make_generator, sample_row

torch.set_num_threads(1)

KERNELS = ops.select(EngineConfig().kernels, EngineConfig().attention)  # what the engine runs by default

VOCAB = 96
LOGITS_ATOL = 1e-4  # float32; observed differences are ~1e-6 (summation order only)
WORDS = [f"w{i}" for i in range(3, VOCAB)]


def save_tiny_checkpoint(path: Path, *, tie: bool, shard: bool = False) -> transformers.LlamaForCausalLM:
    """A random GQA Llama (4 query heads, 2 KV heads) and a word-level tokenizer, in HF format."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(1234 + tie)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # wider than HF's 0.02 init, so greedy tokens depend on the input
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.25 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size="100KB" if shard else "50GB")

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i for i, w in enumerate(WORDS, start=3)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory) -> tuple[transformers.LlamaForCausalLM, LoadedModel]:
    path = tmp_path_factory.mktemp("ckpt")
    hf = save_tiny_checkpoint(path, tie=request.param, shard=not request.param)
    return hf, load_model(str(path), device="cpu", dtype="float32")


def forward_chunks(loaded: LoadedModel, tokens: list[int], chunks: list[int], block_size: int = 8) -> torch.Tensor:
    """Logits (T, V) for one sequence fed through the paged cache `chunks[i]` tokens at a time."""
    c = loaded.config
    n_blocks = (len(tokens) + block_size - 1) // block_size
    shape = (n_blocks, block_size, c.num_key_value_heads, c.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(c.num_hidden_layers)]
    # Blocks in reverse order: a table that is not the identity catches indexing mistakes.
    table = list(reversed(range(n_blocks)))
    out, done = [], 0
    for n in chunks:
        pos = list(range(done, done + n))
        meta = AttentionMetadata(
            batch=PagedBatch(
                cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                context_lens=torch.tensor([done + n], dtype=torch.int32),
                block_tables=torch.tensor([table], dtype=torch.int32),
            ),
            slot_mapping=torch.tensor([table[p // block_size] * block_size + p % block_size for p in pos]),
            query_starts=(0, n), num_decode_seqs=int(n == 1), kernels=KERNELS,
        )
        with torch.inference_mode():
            hidden = loaded.model(torch.tensor(tokens[done:done + n]), torch.tensor(pos), meta, kv)
            out.append(loaded.model.compute_logits(hidden))
        done += n
    return torch.cat(out)


def hf_logits(hf: transformers.LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def test_logits_match_transformers_whole_and_chunked(checkpoint):
    hf, loaded = checkpoint
    tokens = [1] + [(7 * i + 3) % (VOCAB - 3) + 3 for i in range(45)]
    expected = hf_logits(hf, tokens)
    whole = forward_chunks(loaded, tokens, [len(tokens)])  # one prefill
    chunked = forward_chunks(loaded, tokens, [13, 9, 1, 1, 22])  # over a cached prefix, decode steps
    torch.testing.assert_close(whole, expected, atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(chunked, expected, atol=LOGITS_ATOL, rtol=0)
    assert expected.std() > 1.0  # the comparison is not between near-constant logits


def test_greedy_tokens_match_transformers_generate(checkpoint):
    hf, loaded = checkpoint
    prompt = loaded.tokenizer.encode("w5 w17 w42 w8 w8 w60 w33")
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
    tokens = list(prompt)
    for _ in range(40):  # prompt once, then one decode step per token
        logits = forward_chunks(loaded, tokens, [len(prompt)] + [1] * (len(tokens) - len(prompt)))
        tokens.append(int(logits[-1].argmax()))
        if tokens[-1] == 2:
            break
    assert tokens[len(prompt):] == expected
    assert len(set(expected)) > 5  # not a degenerate repetition


def test_hf_tokenizer_adds_bos_and_skips_specials(checkpoint):
    _, loaded = checkpoint
    ids = loaded.tokenizer.encode("w3 w4 w95")
    assert ids == [1, 3, 4, 95]
    assert loaded.tokenizer.decode(ids + [2]) == "w3 w4 w95"
    assert (loaded.tokenizer.bos_token_id, loaded.tokenizer.eos_token_id, loaded.tokenizer.vocab_size) == (1, 2, VOCAB)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode("héllo")
    assert ids[0] == tok.bos_token_id and ids[1:] == list("héllo".encode())
    assert tok.decode(ids + [tok.eos_token_id]) == "héllo"
    assert tok.decode([0xC3]) == "\ufffd"  # a cut multi-byte character does not raise


def test_builtin_is_identical_across_loads():
    a, b = load_model("builtin:tiny", device="cpu"), load_model("builtin:tiny", device="cpu")
    assert a.fingerprint == b.fingerprint and len(a.fingerprint) == 32
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert (a.device.type, a.dtype, a.max_context, a.name) == ("cpu", torch.float32, 1024, "builtin:tiny")


def test_fingerprint_follows_weight_bytes(tmp_path):
    first = save_tiny_checkpoint(tmp_path / "a", tie=False)
    fp_a = load_model(str(tmp_path / "a")).fingerprint
    assert load_model(str(tmp_path / "a")).fingerprint == fp_a
    with torch.no_grad():  # one weight, one value, same shapes and config
        first.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3
    first.save_pretrained(tmp_path / "b")
    (tmp_path / "b" / "tokenizer.json").write_text((tmp_path / "a" / "tokenizer.json").read_text())
    assert load_model(str(tmp_path / "b")).fingerprint != fp_a


def test_seeded_sampling_is_reproducible():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    params = Sampling(temperature=0.9, top_p=0.95, top_k=40, seed=7)

    def draws(p: Sampling) -> list[int]:
        gen = make_generator(p)
        return [sample_row(logits, p, gen) for _ in range(30)]

    assert draws(params) == draws(params)
    assert draws(params) != draws(Sampling(temperature=0.9, top_p=0.95, top_k=40, seed=8))
    assert make_generator(Sampling(temperature=0.0, seed=7)) is None  # greedy ignores the seed


def test_top_k_and_top_p_limit_the_candidates():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    gen = torch.Generator().manual_seed(1)
    top_k = [sample_row(logits, Sampling(temperature=1.0, top_k=2), gen) for _ in range(2000)]
    assert set(top_k) == {0, 1}
    top_p = [sample_row(logits, Sampling(temperature=1.0, top_p=0.7), gen) for _ in range(2000)]
    assert set(top_p) == {0, 1}  # 0.5 < 0.7 keeps token 1; 0.8 >= 0.7 drops token 2
    assert abs(top_p.count(0) / 2000 - 0.5 / 0.8) < 0.04  # renormalised over what is kept
    full = [sample_row(logits, Sampling(temperature=1.0), gen) for _ in range(2000)]
    assert set(full) == {0, 1, 2, 3}
    assert all(sample_row(logits, Sampling(temperature=1.0, top_k=1), gen) == 0 for _ in range(50))


def test_stop_string_ends_and_cuts_the_text(checkpoint):
    _, loaded = checkpoint
    prompt = loaded.tokenizer.encode("w9 w10 w11")
    with Engine(loaded, EngineConfig(num_blocks=64)) as engine:
        full = engine.generate("full", prompt, 30, ignore_eos=True)
        stop = " " + full.text.split()[12]
        cut = engine.generate("cut", prompt, 30, Sampling(stop=[stop]), ignore_eos=True)
    # Generation ends on the first token whose text completes the stop string.
    ends = next(k for k in range(1, 31) if stop in loaded.tokenizer.decode(full.tokens[:k]))
    assert cut.finish_reason == "stop"
    assert cut.tokens == full.tokens[:ends]
    assert cut.text == full.text[:full.text.index(stop)]
    assert 0 < len(cut.text) < len(full.text)


def test_tokenizer_and_config_load_without_weights(tmp_path):
    save_tiny_checkpoint(tmp_path / "ckpt", tie=True)
    for f in (tmp_path / "ckpt").glob("*.safetensors"):
        f.unlink()  # the API and the scheduler count tokens on machines without the weights
    info = load_model_info(str(tmp_path / "ckpt"))
    assert (info.encode("w7"), info.config.num_key_value_heads, info.config.tie_word_embeddings, info.name) == (
        [1, 7], 2, True, "ckpt")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(str(tmp_path / "ckpt"))
    info = load_model_info("builtin:bench")
    assert (info.tokenizer.vocab_size, info.max_context, info.vocab_size, info.name) == (258, 4096, 258, "builtin:bench")


def test_missing_files_and_unsupported_configs_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))
    save_tiny_checkpoint(tmp_path / "ok", tie=False)
    (tmp_path / "ok" / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(str(tmp_path / "ok"))
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    with pytest.raises(ValueError, match="RoPE scaling 'llama3'"):
        LlamaConfig.from_hf_dict({**config, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}})
    with pytest.raises(ValueError, match="model_type 'mistral'"):
        LlamaConfig.from_hf_dict({**config, "model_type": "mistral"})
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        LlamaConfig.from_hf_dict({**config, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match="unknown built-in model"):
        load_model("builtin:huge")
