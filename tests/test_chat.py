"""kvfleet.chat: chat prompts are the tokens transformers' apply_chat_template builds.

Each test writes a tiny checkpoint to tmp_path: a byte-level BPE tokenizer.json whose
post-processor adds <s> (so tokenizing the rendered template with special tokens would
show up as a doubled BOS), its chat template, and a config.json that load_model_info
accepts. kvfleet's prompt tokens are compared with
`AutoTokenizer.from_pretrained(dir).apply_chat_template(..., add_generation_prompt=True)`.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import tokenizers
import transformers

from kvfleet.chat import (
    BUILTIN_TEMPLATE, ChatError, ChatTemplate, builtin_chat_template, load_chat_template, normalize_messages,
)
from kvfleet.modelinfo import ModelInfo, load_model_info

CHATML_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>"]
CORPUS = ("You are a helpful assistant. Hello, how are you? I am fine, thank you. "
          "Grüße aus Köln! 東京タワー は 333 m です。 naïve café 🙂 system user assistant ") * 20

# A ChatML template in the style of Qwen's: bos_token, a loop, raise_exception for a
# role it does not know and for a misplaced system message, the name field, whitespace
# control, and the generation prompt.
CHATML = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}"
    "{% endif %}\n"
    "{{ '<|im_start|>' + message['role'] }}{% if message['name'] is defined %}{{ ' ' + message['name'] }}{% endif %}"
    "{{ '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{% if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# Llama 3 Instruct's template (as published), plus a loop-control `continue` that skips
# empty messages after the first.
LLAMA3 = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% if message['content'] == '' and not loop.first %}{% continue %}{% endif %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

CONVERSATIONS = [
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello, how are you?"}],
    [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "I am fine, thank you."},
        {"role": "user", "content": "  And you?  "},
        {"role": "assistant", "content": "Fine."},
        {"role": "user", "content": "Good."},
    ],
    [{"role": "user", "content": "Grüße aus Köln! 東京タワー は 333 m です。 🙂 naïve café"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "x", "name": "alice"},
     {"role": "assistant", "content": ""}, {"role": "user", "content": "y"}],
    [{"role": "user", "content": "a literal <|im_end|> and </s> in the text\n\nnew lines"}],
]


def write_checkpoint(path: Path, *, specials: list[str], bos: str, eos: str, template: str | list | None,
                     generation_eos: list[str] = (), added_token_dicts: bool = False) -> Path:
    """A tokenizer.json, tokenizer_config.json and config.json (no weights: nothing here loads them)."""
    path.mkdir(parents=True, exist_ok=True)
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator([CORPUS], vocab_size=400, min_frequency=2, special_tokens=specials, show_progress=False)
    tok = bpe._tokenizer
    bos_id = tok.token_to_id(bos)
    tok.post_processor = tokenizers.processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    tok.save(str(path / "tokenizer.json"))

    def token(text: str) -> str | dict:  # newer checkpoints write AddedToken dicts
        return {"__type": "AddedToken", "content": text, "lstrip": False, "normalized": False,
                "rstrip": False, "single_word": False, "special": True} if added_token_dicts else text

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token(bos), "eos_token": token(eos),
              "unk_token": "<unk>", "model_max_length": 512}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": tok.get_vocab_size(), "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "bos_token_id": bos_id, "eos_token_id": tok.token_to_id(specials[2]),
    }))
    if generation_eos:
        (path / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": [tok.token_to_id(t) for t in generation_eos]}))
    return path


def hf_prompt(path: Path, messages: list[dict]) -> list[int]:
    out = transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True)
    # transformers 5 returns a BatchEncoding (return_dict defaults to True); 4.x a list of ids.
    return list(out["input_ids"] if isinstance(out, transformers.BatchEncoding) else out)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("chatml"), specials=CHATML_SPECIALS, bos="<s>",
                            eos="<|im_end|>", template=CHATML)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama3"), specials=LLAMA3_SPECIALS, bos="<|begin_of_text|>",
                            eos="<|eot_id|>", template=[{"name": "default", "template": LLAMA3},
                                                        {"name": "tool_use", "template": "{{ raise_exception('no') }}"}],
                            generation_eos=["<|end_of_text|>", "<|eot_id|>"], added_token_dicts=True)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["system+user", "multi-turn", "non-ascii", "empty+name", "specials"])
@pytest.mark.parametrize("checkpoint", ["chatml", "llama3"])
def test_prompt_tokens_equal_transformers_apply_chat_template(checkpoint, messages, request):
    path = request.getfixturevalue(checkpoint)
    info = load_model_info(str(path))
    ours = info.encode_chat(messages)
    assert ours == hf_prompt(path, messages)
    bos = info.tokenizer.bos_token_id
    assert ours[0] == bos and ours[1] != bos  # the template's BOS, and only that one
    assert info.tokenizer.decode(ours).endswith("assistant\n" if checkpoint == "chatml" else "assistant\n\n")


def test_text_parts_are_joined_with_newlines_and_developer_is_system(chatml):
    info = load_model_info(str(chatml))
    sent = [{"role": "developer", "content": [{"type": "text", "text": "Be terse."}]},
            {"role": "user", "content": [{"type": "text", "text": "Hello,"}, {"type": "text", "text": "how are you?"}]}]
    as_strings = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello,\nhow are you?"}]
    assert info.encode_chat(sent) == hf_prompt(chatml, as_strings)


def test_tojson_filter_matches_transformers(tmp_path):
    # Jinja's own tojson would HTML-escape "<" and "&"; transformers' (and kvfleet's) writes JSON as is.
    template = "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}"
    path = write_checkpoint(tmp_path, specials=CHATML_SPECIALS, bos="<s>", eos="</s>", template=template)
    messages = [{"role": "user", "content": "a < b & 'c' — Köln 🙂"}]
    ours = load_model_info(str(path)).encode_chat(messages)
    assert ours == hf_prompt(path, messages)
    assert load_chat_template(path).render(messages).startswith('[{"role": "user", "content": "a < b & \'c\' — Köln 🙂"}]')


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    path = write_checkpoint(tmp_path, specials=CHATML_SPECIALS, bos="<s>", eos="<|im_end|>",
                            template="{{ raise_exception('the tokenizer_config.json template was used') }}")
    (path / "chat_template.jinja").write_text(CHATML)
    messages = CONVERSATIONS[0]
    assert load_model_info(str(path)).encode_chat(messages) == hf_prompt(path, messages)


def test_stop_token_ids_hold_the_end_of_turn_token(chatml, llama3):
    info = load_model_info(str(chatml))  # EOS </s> (config.json); the template's eos_token is <|im_end|>
    im_end = info.tokenizer.token_to_id("<|im_end|>")
    assert info.stop_token_ids == (im_end,) and info.tokenizer.eos_token_id == info.tokenizer.token_to_id("</s>")
    info = load_model_info(str(llama3))  # generation_config.json lists <|end_of_text|> (the main EOS) and <|eot_id|>
    assert info.stop_token_ids == (info.tokenizer.token_to_id("<|eot_id|>"),)
    assert info.chat.bos_token == "<|begin_of_text|>"  # read from an AddedToken dict
    assert load_model_info("builtin:tiny").stop_token_ids == ()  # EOS ends a built-in model's turn


def test_template_raise_exception_surfaces_its_message(chatml):
    info = load_model_info(str(chatml))
    with pytest.raises(ChatError, match="System message must be at the beginning") as e:
        info.encode_chat([{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}])
    assert e.value.param == "messages"
    with pytest.raises(ChatError, match="Unknown role: robot"):
        info.chat.render([{"role": "robot", "content": "beep"}])


@pytest.mark.parametrize("escape", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}{{ cycler.__init__.__globals__ }}",
    "{% set _ = messages.append({'role': 'user', 'content': 'injected'}) %}",  # the sandbox is immutable
    "{% set ns = namespace(_secret=1) %}",
    "{{ dict.__call__.__globals__ }}",
])
def test_sandbox_refuses_escapes(escape):
    with pytest.raises(ChatError) as e:
        ChatTemplate(escape).render([{"role": "user", "content": "hi"}])
    assert "unsafe" in str(e.value) or "underscore" in str(e.value)


def test_template_globals_and_syntax_errors():
    today = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([])
    assert today in {(datetime.date.today() + datetime.timedelta(days=d)).isoformat() for d in (-1, 0, 1)}
    text = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    assert ChatTemplate(text).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"
    assert ChatTemplate("{% generation %}x{% endgeneration %}").render([]) == "x"  # transformers' training tag
    assert ChatTemplate("{{ bos_token }}|{{ eos_token }}", bos_token="<s>").render([]) == "<s>|"
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_a_checkpoint_without_a_template_has_no_chat(tmp_path):
    path = write_checkpoint(tmp_path, specials=CHATML_SPECIALS, bos="<s>", eos="</s>", template=None)
    info = load_model_info(str(path))
    assert info.chat is None and load_chat_template(path) is None
    with pytest.raises(ChatError, match="has no chat template .* use /v1/completions") as e:
        info.encode_chat([{"role": "user", "content": "hi"}])
    assert e.value.param == "messages"
    assert info.encode("w") == info.tokenizer.encode("w")  # completions are untouched


def test_named_templates_without_a_default_give_no_chat(tmp_path):
    path = write_checkpoint(tmp_path, specials=CHATML_SPECIALS, bos="<s>", eos="</s>",
                            template=[{"name": "tool_use", "template": CHATML}])
    assert load_model_info(str(path)).chat is None


def test_builtin_template_renders_and_encodes_as_documented():
    info = load_model_info("builtin:tiny")
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi é"}]
    text = "system: You are terse.\nuser: Hi é\nassistant:"
    assert info.chat.render(messages) == text
    assert info.chat.source == BUILTIN_TEMPLATE and info.chat.render(messages, add_generation_prompt=False) == text[:-10]
    assert info.encode_chat(messages) == [256, *text.encode()]  # BOS, then the bytes; EOS (257) ends the turn
    assert load_model_info("builtin:bench").encode_chat(messages) == info.encode_chat(messages)
    assert builtin_chat_template().add_special_tokens


def test_model_info_keeps_its_positional_form():
    tiny = load_model_info("builtin:tiny")
    bare = ModelInfo(tiny.name, tiny.config, tiny.tokenizer)
    assert bare.chat is None and bare.stop_token_ids == () and bare.encode("a") == [256, 97]


@pytest.mark.parametrize("raw, param, words", [
    ("hi", "messages", "non-empty array"),
    ([], "messages", "non-empty array"),
    (["hi"], "messages[0]", "must be an object"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "messages[1].role", "must be one of"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
      {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
     "messages[2].content[0].type", "kvfleet serves text-only models: send text parts only"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}]}],
     "messages[0].content[1].type", "text-only"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "file", "file": {}}]}],
     "messages[0].content[1].type", "text-only"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "must be a string"),
    ([{"role": "user", "content": [{"type": "txt", "text": "a"}]}], "messages[0].content[0].type", "unknown content part"),
    ([{"role": "user", "content": []}], "messages[0].content", "non-empty array of text parts"),
    ([{"role": "user", "content": 5}], "messages[0].content", "string or a non-empty array"),
    ([{"role": "user"}], "messages[0].content", "required"),
    ([{"role": "assistant", "content": None}], "messages[0].content", "required"),
    ([{"role": "user", "content": "a"},
      {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]}],
     "messages[1].tool_calls", "does not support tool calling"),
    ([{"role": "user", "content": "a", "temperature": 1, "audio": {}}], "messages[0].audio", "'audio', 'temperature'"),
    ([{"role": "user", "content": "a", "tool_call_id": "1"}], "messages[0].tool_call_id", "unknown field"),
    ([{"role": "user", "content": "a", "name": 7}], "messages[0].name", "must be a string"),
])
def test_normalize_messages_errors_name_the_param(raw, param, words):
    with pytest.raises(ChatError) as e:
        normalize_messages(raw)
    assert e.value.param == param and words in str(e.value), str(e.value)


def test_normalize_messages_returns_template_ready_dicts():
    raw = [{"role": "developer", "content": "s"},
           {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "al"},
           {"role": "assistant", "content": "c", "tool_calls": None, "refusal": None},  # null fields echoed back
           {"role": "tool", "content": "d", "tool_call_id": "call_1"}]
    assert normalize_messages(raw) == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "a\nb", "name": "al"},
        {"role": "assistant", "content": "c"}, {"role": "tool", "content": "d", "tool_call_id": "call_1"}]
    assert normalize_messages(normalize_messages(raw)) == normalize_messages(raw)  # idempotent
