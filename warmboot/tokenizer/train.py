"""Train the small byte-level BPE tokenizer used by the demo model and the tests.

The tokenizer is GPT-2/SmolLM shaped: ByteLevel pre-tokenizer and decoder, no BOS added,
``<|endoftext|>`` at id 0 (bos/eos/unk/pad) and ChatML ``<|im_start|>``/``<|im_end|>``.
Training is deterministic and the final vocabulary size equals the requested size exactly.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = (ENDOFTEXT, "<|im_start|>", "<|im_end|>")
MODEL_MAX_LENGTH = 2048

CHAT_TEMPLATE = (
    # Tools follow the Hugging Face convention (``tools=`` JSON schemas; assistant messages with
    # ``tool_calls``; ``tool`` messages) in the Hermes layout Qwen2/3 use: a system block that
    # lists the tools, calls as <tool_call> JSON, results as <tool_response> user turns.
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    '{{ \'\\n</tools>\\nCall one as <tool_call>\\n{"name": <name>, "arguments": <arguments>}\''
    " + '\\n</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools and loop.first %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% set f = call['function'] if call.get('function') else call %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{ f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson) }}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>"
    "<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)

_ONSETS = "b c d f g h j k l m n p r s t v w z br cr dr fl gr pl st th sh ch tr".split()
_VOWELS = "a e i o u ai ea ou y".split()
_CODAS = ["", "", "", "n", "r", "s", "l", "m", "t", "nd", "st", "x"]
_SYNTH_SEED = 1234
_SYNTH_START_WORDS = 24_000
_SYNTH_MAX_ROUNDS = 12


def train_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens and save it into ``out_dir``.

    Writes ``tokenizer.json`` and ``tokenizer_config.json`` (ChatML template, eos
    ``<|endoftext|>``), loadable by ``transformers.AutoTokenizer`` and
    ``tokenizers.Tokenizer.from_file``. Raises ``ValueError`` for sizes below the byte
    alphabet plus special tokens.
    """
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size}, got {vocab_size}")
    corpus = CORPUS_PATH.read_text(encoding="utf-8")
    tok = _train(vocab_size, [corpus])
    n_words = _SYNTH_START_WORDS
    for _ in range(_SYNTH_MAX_ROUNDS):
        if tok.get_vocab_size() >= vocab_size:
            break
        tok = _train(vocab_size, [corpus, *_synthetic_lines(n_words)])
        n_words = n_words * 3 // 2
    size = tok.get_vocab_size(with_added_tokens=True)
    assert size == vocab_size, f"trained vocab has {size} tokens, wanted {vocab_size}"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config()
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def tokenizer_config() -> dict:
    """The ``tokenizer_config.json`` content written next to ``tokenizer.json``."""
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "bos_token": ENDOFTEXT,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": ENDOFTEXT,
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": ENDOFTEXT,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": ENDOFTEXT,
    }


def _train(vocab_size: int, texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def _synthetic_lines(n_words: int) -> Iterator[str]:
    """Lines of ``n_words`` distinct seeded pseudo-words, repeated with Zipf-like counts."""
    rng = random.Random(_SYNTH_SEED)
    seen: set[str] = set()
    words: list[str] = []
    while len(words) < n_words:
        word = _pseudo_word(rng)
        if word not in seen:
            seen.add(word)
            words.append(word)
    line: list[str] = []
    for rank, word in enumerate(words, start=1):
        line.extend([word] * max(1, 2000 // rank))
        if len(line) >= 64:
            yield " ".join(line)
            line = []
    if line:
        yield " ".join(line)


def _pseudo_word(rng: random.Random) -> str:
    n_syllables = rng.choice((1, 2, 2, 3, 3, 3, 4, 4, 5))
    parts = [
        rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(n_syllables)
    ]
    word = "".join(parts)
    return word.capitalize() if rng.random() < 0.1 else word
