"""The tiny checkpoint's tokenizer: a byte-level BPE built offline with `tokenizers`, plus GLM's chat
special tokens and a chat template with GLM-5.3's conventions (glm53/serving/front/glm_markup.py lists them and their
sources). Deterministic: the merges are trained on a fixed built-in corpus, and the added tokens sit at
fixed ids at the top of the vocabulary (as in GLM).
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 2048  # the model's vocab_size; the BPE fills the ids below the special tokens

# GLM's added tokens (a subsequence of GLM's list, in GLM's order); ids are
# VOCAB_SIZE - len(SPECIAL_TOKENS) + index
SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
)
FIRST_SPECIAL_ID = VOCAB_SIZE - len(SPECIAL_TOKENS)
# GLM's tokenizer.json marks the thinking and tool markup "special": false, so a decode that skips
# special tokens keeps them as text; the tiny tokenizer does the same (they are still single tokens).
MARKUP_TOKENS = frozenset(SPECIAL_TOKENS[SPECIAL_TOKENS.index("<think>"):])


def special_id(token: str) -> int:
    return FIRST_SPECIAL_ID + SPECIAL_TOKENS.index(token)


EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")  # GLM stops at these
PAD_TOKEN = "<|endoftext|>"

# GLM-5.3's conventions (glm53/serving/front/glm_markup.py has the facts and sources): [gMASK]<sop>, the reasoning
# effort line, the tools block, then <|role|>content turns with no separator; an assistant turn replays
# its reasoning as <think>...</think> (empty when it has none), its content stripped, then its tool calls
# as <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call> (strings raw, other
# values as JSON); a run of tool results is one <|observation|> with a <tool_response> each. The reply
# opens with <|assistant|><think>. One addition of the kit's: enable_thinking=false opens it closed,
# <think></think>, the same ids glm_markup appends to the stock template's prompt for thinking off.
# Messages come in as glm53/serving/front/glm_markup.render_messages gives them (tool results already in call order).
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort in ['low', 'high']"
    " else 'max' -%}"
    "<|system|>Reasoning Effort: {{ effort | capitalize }}"
    "{%- if tools -%}"
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{% for tool in tools %}"
    "{{ (tool.function if tool.function is defined else tool) | tojson(ensure_ascii=False) }}{{ '\\n' }}"
    "{% endfor %}"
    "</tools>\n\nFor each function call, output the function name and arguments within the following"
    " XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>{{ m.content }}"
    "{%- elif m.role == 'user' -%}<|user|>{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|>"
    "{%- if m.reasoning_content is string"
    " and (not (clear_thinking is defined and clear_thinking) or loop.index0 > ns.last_user) -%}"
    "<think>{{ m.reasoning_content }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ (m.content or '').strip() }}"
    "{%- for tc in m.tool_calls or [] -%}<tool_call>{{ tc.function.name }}"
    "{%- for k, v in tc.function.arguments.items() -%}"
    "<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson(ensure_ascii=False) }}</arg_value>"
    "{%- endfor -%}</tool_call>"
    "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}"
    "<tool_response>{{ m.content }}</tool_response>"
    "{%- else -%}{{ raise_exception('unknown role ' ~ m.role) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "<|assistant|>{{ '<think></think>' if enable_thinking is defined and not enable_thinking else '<think>' }}"
    "{%- endif -%}"
)

_CORPUS_LINES = (
    "The quick brown fox jumps over the lazy dog.",
    "A serving kit runs the model across several machines and answers chat completions.",
    "def forward(self, hidden_states, position_ids, cache=None):\n    return self.norm(hidden_states)",
    "import torch\nfrom pathlib import Path\nprint('hello, world')",
    "Tokens are counted by the engine; the first token arrives after the prompt is processed.",
    "Mixture of experts layers route each token to a few experts chosen by a learned gate.",
    "Attention reads keys and values from a cache that grows by one row per generated token.",
    "1 2 3 4 5 6 7 8 9 10 11 12 100 1000 3.14159 2.71828 0x1f 42",
    "Question: what is the capital of France? Answer: Paris.",
    "The weather today is sunny with a light breeze from the west.",
    "User asked for a short poem about the sea; the assistant wrote four lines.",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Berlin\", \"unit\": \"celsius\"}}",
    "Ein kleiner Text auf Deutsch. Un petit texte en francais. Un breve testo in italiano.",
    "for i in range(10):\n    if i % 2 == 0:\n        continue\n    total += i",
)


def corpus() -> list[str]:
    """The fixed training corpus: the lines, and their words recombined in a fixed order."""
    lines = list(_CORPUS_LINES)
    words = " ".join(_CORPUS_LINES).split()
    for stride in (3, 5, 7, 11, 13):
        lines.append(" ".join(words[i] for i in range(0, len(words), stride)))
        lines.append(" ".join(reversed(words[::stride])))
    return lines * 4


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=FIRST_SPECIAL_ID,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    n = tok.get_vocab_size()
    if n > FIRST_SPECIAL_ID:
        raise AssertionError(f"BPE grew to {n} ids, above the {FIRST_SPECIAL_ID} reserved for it")
    # pad with unused ids so the special tokens land at their fixed ids at the top of the vocab
    filler = [f"<|reserved_{i}|>" for i in range(n, FIRST_SPECIAL_ID)]
    if filler:
        tok.add_tokens(filler)
    for t in SPECIAL_TOKENS:  # one at a time: the ids follow SPECIAL_TOKENS' order
        if t in MARKUP_TOKENS:
            tok.add_tokens([AddedToken(t, normalized=False, special=False)])
        else:
            tok.add_special_tokens([AddedToken(t, normalized=False, special=True)])
    for t in SPECIAL_TOKENS:
        if tok.token_to_id(t) != special_id(t):
            raise AssertionError(f"special token {t} got id {tok.token_to_id(t)}, expected {special_id(t)}")
    return tok


def write_tokenizer(out_dir: Path) -> dict[str, object]:
    """Write tokenizer.json and tokenizer_config.json; returns the ids config.json needs."""
    tok = build_tokenizer()
    (out_dir / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    added = {
        str(special_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": t not in MARKUP_TOKENS,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 32768,
        "added_tokens_decoder": added,
        "eos_token": "<|endoftext|>",
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "padding_side": "left",
        "remove_space": False,
        "chat_template": CHAT_TEMPLATE,
        "extra_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>" and t not in MARKUP_TOKENS],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n", encoding="utf-8")
    return {
        "eos_token_id": [special_id(t) for t in EOS_TOKENS],
        "pad_token_id": special_id(PAD_TOKEN),
        "bos_token_id": special_id("[gMASK]"),
    }
