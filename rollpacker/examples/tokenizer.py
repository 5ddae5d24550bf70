"""A tiny word-level HF tokenizer for the stepchain task.

Every number 0..MAX_STEPS, every operation ("+3", "*7"), the few words of the
prompt, single punctuation and whitespace characters are one token each, so a
derivation step is exactly 7 tokens and every prompt the same length.  Decoding concatenates the token strings, so
``decode(encode(text)) == text`` for any text made of known pieces.

Written as ``tokenizer.json`` + ``tokenizer_config.json`` (Qwen-style chat
template, ``<|im_end|>`` as end of sequence and padding) so that
``transformers.AutoTokenizer.from_pretrained(dir)`` loads it.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from rollpacker.examples.task import MAX_STEPS, MODULUS, OPERATIONS

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<|unk|>"
SPECIAL_TOKENS = (IM_END, IM_START, UNK)  # <|im_end|> is id 0: EOS and padding

WORDS = ("Start", "at", "apply", "times", "mod", "Answer", "user", "assistant", "system")
PUNCTUATION = (" ", "\n", ",", ".", ":", "=", "+", "-", "*")

# An operation before a bare number: "7+3" is "7", "+3".
_PIECE = r"[+\-*]\d|\d+|[A-Za-z]+|\s|."

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def user_prompt(content: str) -> str:
    """``CHAT_TEMPLATE`` applied to one user message with the generation prompt, without jinja."""
    return f"{IM_START}user\n{content}{IM_END}\n{IM_START}assistant\n"


def vocabulary() -> list[str]:
    numbers = [str(i) for i in range(max(MAX_STEPS, MODULUS) + 1)]
    return [*SPECIAL_TOKENS, *PUNCTUATION, *WORDS, *numbers, *OPERATIONS]


def build_tokenizer() -> Tokenizer:
    vocab = {token: i for i, token in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_PIECE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": IM_END,
        "unk_token": UNK,
        "bos_token": None,
        "add_bos_token": False,
        "model_max_length": 1024,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
