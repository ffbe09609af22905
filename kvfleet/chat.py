"""OpenAI chat `messages` -> the prompt text the model was trained on, rendered with the
checkpoint's own chat template.

A chat model learnt one exact layout of a conversation (role markers, turn ends, where
BOS goes); any other layout is a guess that degrades its answers. So a checkpoint's
template is rendered exactly as Hugging Face transformers' `apply_chat_template` does
(`transformers/utils/chat_template_utils.py`): a sandboxed, immutable Jinja2 environment
with trim_blocks/lstrip_blocks, the loop-control extension, transformers' globals and
filters (`raise_exception`, `strftime_now`, a JSON-faithful `tojson`, hardened `dict`
and `namespace`), and `messages`, `tools=None`, `documents=None`,
`add_generation_prompt`, `bos_token`, `eos_token` as variables. A checkpoint without a
template gets no chat (the API answers 400), never a made-up layout.

Three steps, one per name:
- `normalize_messages(raw)`: validate what a client sent; plain {"role", "content"} dicts.
- `ChatTemplate.render(messages)`: the prompt text.
- `load_chat_template(dir)`: a checkpoint's template and its BOS/EOS strings, or None.

The built-in models (`builtin:tiny`, `builtin:bench`) have a byte tokenizer with no
special-token text, so they get this small template (`builtin_chat_template()`): one
line per message, then the generation prompt,

    system: You are terse.
    user: Hi
    assistant:

(no newline after "assistant:"). Its text is encoded with `ByteTokenizer.encode`, which
puts BOS (256) first, and the assistant's turn ends at EOS (257).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from functools import lru_cache
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

#: What a client may send as `role`, and the role the template sees. "developer" is
#: OpenAI's newer name for "system"; templates only know "system" (vLLM maps it so too).
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
#: Content-part types of OpenAI's API that carry media: refused with a message saying why.
MEDIA_PARTS = frozenset({"image_url", "input_audio", "file", "video_url", "audio_url"})
#: Joins the text parts of one message. vLLM's "string" content format joins them with
#: "\n" (transformers leaves the list to the template, which most templates cannot
#: render); kvfleet does as vLLM, so a string template always sees a string.
PART_SEPARATOR = "\n"
#: Templates from checkpoints are untrusted code: Jinja2 before 3.1.6 has known sandbox
#: escapes, which is why transformers refuses older versions too.
MIN_JINJA2 = (3, 1, 6)


class ChatError(ValueError):
    """The messages cannot become a prompt for this model: the client must change `param`."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# --- messages ---------------------------------------------------------------------

def normalize_messages(raw: object) -> list[dict]:
    """Validate OpenAI chat `messages` as a client sends them (JSON-decoded) and return
    plain {"role", "content"[, "name"][, "tool_call_id"]} dicts, content always a string.

    Keys whose value is null count as absent (clients echo `tool_calls: null` back), as
    transformers drops them before rendering.
    """
    if not isinstance(raw, list) or not raw:
        raise ChatError("messages must be a non-empty array of message objects", param="messages")
    return [_normalize_message(m, f"messages[{i}]") for i, m in enumerate(raw)]


def _normalize_message(message: object, where: str) -> dict:
    if not isinstance(message, dict):
        raise ChatError(f"{where} must be an object with 'role' and 'content'", param=where)
    message = {k: v for k, v in message.items() if v is not None}
    role = message.get("role")
    if role not in ROLES:
        raise ChatError(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", param=f"{where}.role")
    for key in ("tool_calls", "function_call"):
        if key in message:
            raise ChatError(f"{where}.{key}: kvfleet does not support tool calling; send text messages only",
                            param=f"{where}.{key}")
    allowed = {"role", "content", "name"} | ({"tool_call_id"} if role == "tool" else set())
    unknown = sorted(set(message) - allowed)
    if unknown:
        raise ChatError(f"{where} has unknown field(s) {unknown}; a {role} message takes {sorted(allowed)}",
                        param=f"{where}.{unknown[0]}")
    if "content" not in message:
        raise ChatError(f"{where}.content is required", param=f"{where}.content")
    out = {"role": ROLES[role], "content": _content_text(message["content"], f"{where}.content")}
    for key in ("name", "tool_call_id"):
        if key in message:
            if not isinstance(message[key], str):
                raise ChatError(f"{where}.{key} must be a string", param=f"{where}.{key}")
            out[key] = message[key]
    return out


def _content_text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise ChatError(f"{where} must be a string or a non-empty array of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise ChatError(f"{here} must be an object {{\"type\": \"text\", \"text\": ...}}", param=here)
        kind = part.get("type")
        if kind != "text":
            why = "kvfleet serves text-only models: send text parts only" if kind in MEDIA_PARTS else \
                f"unknown content part type {kind!r}: send {{\"type\": \"text\", \"text\": ...}} parts"
            raise ChatError(f"{here}.type is {kind!r}: {why}", param=f"{here}.type")
        if not isinstance(part.get("text"), str):
            raise ChatError(f"{here}.text must be a string", param=f"{here}.text")
        unknown = sorted(set(part) - {"type", "text"})
        if unknown:
            raise ChatError(f"{here} has unknown field(s) {unknown}; a text part takes 'type' and 'text'",
                            param=f"{here}.{unknown[0]}")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


# --- the sandbox (transformers' chat_template_utils, minus assistant-mask tracking) --

def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' (it is meant for HTML pages); a prompt
    # must carry the JSON verbatim, so this is json.dumps with transformers' defaults.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without handing the template the `dict` type
    itself, whose attributes are a way out of the sandbox."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing underscore names, which lead to CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's own trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body. transformers uses the tag
    to mark assistant tokens for training masks; kvfleet only needs such templates to compile."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    found = tuple(int(x) for x in re.findall(r"\d+", version("jinja2"))[:3])
    if found < MIN_JINJA2:
        raise ImportError(f"chat templates need jinja2>={'.'.join(map(str, MIN_JINJA2))} (older versions have "
                          f"sandbox escapes); found {version('jinja2')}: pip install -U jinja2")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    # Every process loads the same one or two templates; load_model_info may run many times.
    return _environment().from_string(source)


# --- the template -------------------------------------------------------------------

class ChatTemplate:
    """A compiled chat template and the special-token strings it may write.

    `add_special_tokens`: whether the tokenizer adds its own special tokens (BOS) to the
    rendered text. False for checkpoint templates, which write BOS themselves (transformers
    tokenizes their output with add_special_tokens=False); True for the built-in template,
    whose byte tokenizer has no BOS text a template could write.
    """

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None,
                 add_special_tokens: bool = False) -> None:
        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e.message} (template line {e.lineno})") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_special_tokens = add_special_tokens

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The prompt text; ChatError when the template refuses the messages (its
        `raise_exception`, or an access the sandbox forbids)."""
        # Only the special tokens that are set, as transformers passes its special_tokens_map.
        special = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v is not None}
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **special)
        except jinja2.TemplateError as e:
            raise ChatError(f"the model's chat template refused these messages: {e.message or e}",
                            param="messages") from None


#: The built-in models' template: see the module docstring.
BUILTIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def builtin_chat_template() -> ChatTemplate:
    return ChatTemplate(BUILTIN_TEMPLATE, add_special_tokens=True)


# --- loading from a checkpoint --------------------------------------------------------

def load_chat_template(checkpoint_dir: Path) -> ChatTemplate | None:
    """The checkpoint's template: `chat_template.jinja` if present (as transformers, which
    saves single templates there), else tokenizer_config.json's `chat_template` (a string,
    or a list of {"name", "template"} of which the one named "default" is used). BOS/EOS
    strings come from tokenizer_config.json, else the older special_tokens_map.json.
    None when the checkpoint has no (default) template."""
    checkpoint_dir = Path(checkpoint_dir)
    config = _read_json(checkpoint_dir / "tokenizer_config.json")
    jinja_file = checkpoint_dir / "chat_template.jinja"
    if jinja_file.is_file():
        source: str | None = jinja_file.read_text(encoding="utf-8")
    else:
        source = _default_template(config.get("chat_template"))
    if source is None:
        return None
    legacy = _read_json(checkpoint_dir / "special_tokens_map.json")
    tokens = {key: _token_text(config.get(key)) or _token_text(legacy.get(key)) for key in ("bos_token", "eos_token")}
    try:
        return ChatTemplate(source, **tokens)
    except ValueError as e:
        raise ValueError(f"{checkpoint_dir}: {e}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _default_template(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and "name" in t and "template" in t for t in value):
        # Named templates without a "default" (e.g. only "tool_use"): kvfleet sends no
        # tools, so none applies; transformers refuses such a call too.
        return next((t["template"] for t in value if t["name"] == "default"), None)
    raise ValueError("tokenizer_config.json: chat_template must be a string or a list of {\"name\", \"template\"}")


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken
    dict ({"__type": "AddedToken", "content": "<s>", ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
