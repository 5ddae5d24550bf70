"""A tiny Qwen2-style byte-level BPE tokenizer for the stepchain task.

It is a Qwen2 tokenizer in everything but size: the Qwen2 pre-tokenizer regex
(digits one by one, punctuation runs apart from words), byte-level BPE over
the 256 byte symbols, and merges only for the handful of words the task uses.
That matters because ``transformers`` 5 rebuilds the tokenizer of any
``qwen2`` checkpoint as ``Qwen2Tokenizer`` from the vocabulary and merges in
``tokenizer.json``, whatever ``tokenizer_config.json`` names: a tokenizer of
another kind would silently encode differently there than here.

Written as ``tokenizer.json`` + ``tokenizer_config.json`` (Qwen chat template,
``<|im_end|>`` as end of sequence and padding) so that
``transformers.AutoTokenizer.from_pretrained(dir)`` loads it.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (IM_END, IM_START)  # <|im_end|> is id 0: EOS and padding

# The pre-tokenizer regex of Qwen2's tokenizer.json.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Words of the prompt, the answer line and the chat roles, as the pre-tokenizer cuts them.
WORDS = ("Start", " at", " apply", " times", " mod", "Answer", "user", "assistant", "system")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def user_prompt(content: str) -> str:
    """``CHAT_TEMPLATE`` applied to one user message with the generation prompt, without jinja."""
    return f"{IM_START}user\n{content}{IM_END}\n{IM_START}assistant\n"


def _byte_level(text: str) -> str:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)[0][0]


def vocabulary_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    tokens = [*SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet())]
    merges = []
    for word in map(_byte_level, WORDS):  # grow each word left to right: S+t, St+a, ...
        for end in range(2, len(word) + 1):
            merges.append((word[: end - 1], word[end - 1]))
            tokens.append(word[:end])
    return {token: i for i, token in enumerate(dict.fromkeys(tokens))}, merges


def build_tokenizer() -> Tokenizer:
    vocab, merges = vocabulary_and_merges()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": IM_END,
        "pad_token": IM_END,
        "unk_token": None,
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": 1024,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
