"""Train the embedded English model, `builtin:english` (kvfleet/models/english/).

    apt-get install fortunes          # the corpus: Debian's BSD-licensed fortune(6) texts
    python scripts/train_english.py [--minutes 12] [--out kvfleet/models/english]

What it makes, in Hugging Face format so that kvfleet loads it like any checkpoint:
config.json (a Llama, ~2.3 M parameters), model.safetensors (float16, ~4.5 MB),
tokenizer.json (byte-level BPE, 2,048 tokens, trained here with `tokenizers`),
tokenizer_config.json (BOS/EOS and a small chat template), training.json (the corpus,
the split, the steps and the held-out perplexity this run measured) and heldout.txt (the
first 150 held-out fortunes, for the model's test).

Corpus: every file of /usr/share/games/fortunes (the `fortunes` package: the
inoffensive set, under the BSD licence of fortune(6)) but the ASCII-art ones, cut into
its fortunes at the `%` lines. Every 20th fortune is held out: the perplexity is
measured on those, never trained on. Each fortune is one sequence, <s> text </s>.

Training uses transformers' LlamaForCausalLM, the same architecture that
workers/model/llama.py serves (tests/test_model.py checks the two agree logit for
logit): kvfleet's own model is inference-only, with a paged KV cache and no autograd
path. AdamW, cosine schedule, on the CPU, for a fixed wall-clock budget; seeded, so a
second run on the same machine and thread count repeats it closely (not bit for bit:
the step count follows the clock).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
CORPUS_DIR = Path("/usr/share/games/fortunes")
SKIP = {"art", "ascii-art"}  # drawings, not prose
VOCAB = 2048
SEQ_LEN = 256
HOLD_OUT_EVERY = 20
HELD_OUT_SHIPPED = 150  # held-out fortunes written beside the model, for its test
SPECIALS = ["<s>", "</s>", "<pad>"]
# A small, documented chat template: the model was trained on fortunes, not dialogue,
# so chat continues the user's turn in that voice; what counts is that the turn ends
# (</s>) and the prompt is built the way a real checkpoint's would be.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def fortunes() -> list[str]:
    if not CORPUS_DIR.is_dir():
        raise SystemExit(f"{CORPUS_DIR} not found: install the corpus with `apt-get install fortunes`")
    texts = []
    for path in sorted(CORPUS_DIR.iterdir()):
        if path.suffix or path.is_symlink() or path.name in SKIP:
            continue  # .dat indexes and .u8 links
        for chunk in path.read_text(encoding="utf-8", errors="replace").split("\n%\n"):
            text = chunk.strip("\n%").strip()
            if len(text) >= 20:
                texts.append(text)
    return texts


def train_tokenizer(train: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train, trainer)
    # encode() adds BOS, as Llama tokenizers do; </s> ends every training sequence.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok


def sequences(tok, texts: list[str]) -> list[list[int]]:
    out = []
    for text in texts:
        ids = tok.encode(text).ids + [1]  # <s> ... </s>
        out.extend(ids[i:i + SEQ_LEN + 1] for i in range(0, len(ids) - 1, SEQ_LEN))
    return [s for s in out if len(s) >= 2]


def batches(seqs: list[list[int]], tokens_per_batch: int, rng: random.Random):
    """Length-bucketed batches of about `tokens_per_batch` tokens, padded with -100 labels."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    groups, group, size = [], [], 0
    for i in order:
        group.append(i)
        size += len(seqs[i])
        if size >= tokens_per_batch:
            groups.append(group)
            group, size = [], 0
    if group:
        groups.append(group)
    while True:
        rng.shuffle(groups)
        for g in groups:
            width = max(len(seqs[i]) for i in g)
            ids = torch.full((len(g), width), 2, dtype=torch.long)  # <pad>
            labels = torch.full((len(g), width), -100, dtype=torch.long)
            for row, i in enumerate(g):
                s = torch.tensor(seqs[i])
                ids[row, :len(s)] = s
                labels[row, :len(s)] = s
            yield ids[:, :-1], labels[:, 1:], (labels[:, 1:] != -100)


def perplexity(model, seqs: list[list[int]]) -> float:
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels, mask in _eval_batches(seqs):
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                     ignore_index=-100, reduction="sum")
            total += loss.item()
            count += int(mask.sum())
    model.train()
    return math.exp(total / count)


def _eval_batches(seqs):
    gen = batches(seqs, 8192, random.Random(0))
    n = math.ceil(sum(map(len, seqs)) / 8192) + 1
    seen = 0
    for batch in gen:
        yield batch
        seen += 1
        if seen >= n:
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=12.0, help="wall-clock training budget")
    parser.add_argument("--out", type=Path, default=ROOT / "kvfleet" / "models" / "english")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    texts = fortunes()
    held = texts[::HOLD_OUT_EVERY]
    train = [t for i, t in enumerate(texts) if i % HOLD_OUT_EVERY]
    print(f"corpus: {len(texts)} fortunes, {sum(map(len, texts)) / 1e6:.2f} MB; {len(held)} held out", flush=True)
    tok = train_tokenizer(train)
    train_seqs, held_seqs = sequences(tok, train), sequences(tok, held)
    print(f"tokens: {sum(map(len, train_seqs))} train, {sum(map(len, held_seqs))} held out", flush=True)

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=True,
                         hidden_act="silu", attention_bias=False, mlp_bias=False)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M parameters", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    budget_s = args.minutes * 60
    started = time.monotonic()
    step, data = 0, batches(train_seqs, 8192, rng)
    while (elapsed := time.monotonic() - started) < budget_s:
        lr = 3e-3 * (min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(1.0, elapsed / budget_s))))
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids, labels, mask = next(data)
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 25 == 0:
            print(f"step {step:5d}  {elapsed:6.0f}s / {budget_s:.0f}s  loss {loss.item():.3f}  lr {lr:.2e}", flush=True)
    ppl = perplexity(model, held_seqs)
    print(f"held-out perplexity {ppl:.2f} (uniform guessing: {VOCAB})", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(args.out, safe_serialization=True)
    for stray in ("generation_config.json",):
        (args.out / stray).unlink(missing_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1024, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    # A sample of the held-out fortunes ships with the model: tests/test_english_model.py
    # measures the perplexity on it where the corpus package is not installed.
    (args.out / "heldout.txt").write_text("\n%\n".join(held[:HELD_OUT_SHIPPED]) + "\n", encoding="utf-8")
    (args.out / "training.json").write_text(json.dumps({
        "corpus": "Debian package `fortunes` (BSD licence of fortune(6)), all files but art and ascii-art",
        "fortunes": len(texts), "held_out_every": HOLD_OUT_EVERY, "train_tokens": sum(map(len, train_seqs)),
        "held_out_tokens": sum(map(len, held_seqs)), "parameters": params, "steps": step,
        "minutes": args.minutes, "threads": args.threads, "held_out_perplexity": ppl, "vocab_size": VOCAB,
        "command": "python scripts/train_english.py " + " ".join(sys.argv[1:]),
    }, indent=2) + "\n")
    print(f"saved to {args.out}", flush=True)


if __name__ == "__main__":
    main()
