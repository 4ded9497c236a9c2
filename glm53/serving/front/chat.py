"""Text side of the front: the checkpoint's tokenizer and chat template.

The tokenizer comes from `tokenizer.json` (the `tokenizers` library); the chat template from
`chat_template.jinja` or `tokenizer_config.json`'s `chat_template`, rendered with jinja2 the way
transformers renders it (sandboxed, trim_blocks/lstrip_blocks, `raise_exception`, `tojson`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TemplateError(ValueError):
    """The checkpoint's chat template failed for a request; the message says why."""


class TemplateArgumentError(TemplateError):
    """chat_template_kwargs named an argument render() passes the template itself."""


RENDER_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' filter signature: GLM's own template calls tojson(ensure_ascii=False)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # tokenizer_config.json may store AddedToken dicts
        return value.get("content")
    return value


class ChatText:
    """Encode prompts, render chat messages, decode completions for one checkpoint."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: missing; the front needs the checkpoint's tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(tok_file))
        cfg_file = model_dir / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.template_source = self._find_template(model_dir, cfg)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        self.template = env.from_string(self.template_source) if self.template_source else None

    @staticmethod
    def _find_template(model_dir: Path, cfg: dict[str, Any]) -> str | None:
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return template

    def render(self, messages: list[dict[str, Any]], tools: list[Any] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        if self.template is None:
            raise TemplateError("the checkpoint has no chat template (tokenizer_config.json chat_template "
                                "or chat_template.jinja); use /v1/completions with a raw prompt")
        clash = sorted(set(template_kwargs or {}) & RENDER_ARGUMENTS)
        if clash:
            raise TemplateArgumentError(f"'chat_template_kwargs' may not set {', '.join(clash)}: the server "
                                        "passes those itself")
        try:
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=True,
                                        bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                        **(template_kwargs or {}))
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        # The template (or the raw prompt) carries its own special tokens. encode_batch, unlike
        # encode, releases the GIL while it tokenizes: a long prompt does not stop the other threads.
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, never splitting a UTF-8 character.

    Each push decodes a short window (the ids since the last delta, and those before it as context),
    not the whole reply: a long stream costs the same per token as a short one."""

    def __init__(self, text: ChatText) -> None:
        self._text = text
        self._ids: list[int] = []
        self._prefix = 0  # the window's context starts here ...
        self._read = 0  # ... and what is already emitted ends here

    def push(self, ids: list[int]) -> str:
        self._ids.extend(ids)
        before = self._text.decode(self._ids[self._prefix:self._read])
        after = self._text.decode(self._ids[self._prefix:])
        if after.endswith("\ufffd") or len(after) <= len(before) or not after.startswith(before):
            return ""  # an incomplete multi-byte character (or nothing visible yet): wait for more tokens
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    def finish(self) -> str:
        """The rest of the text once generation ends (a dangling partial character included)."""
        before = self._text.decode(self._ids[self._prefix:self._read])
        after = self._text.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return after[len(before):] if after.startswith(before) else ""
