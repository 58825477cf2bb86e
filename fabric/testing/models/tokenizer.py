"""Offline byte-level BPE tokenizer for the tiny test models.

No model hub can be reached where fabric's tests run, so the tokenizer is
trained here, with ``tokenizers``, on a small corpus that ships in this module.
The result is written as the files ``PreTrainedTokenizerFast`` loads
(``tokenizer.json`` + ``tokenizer_config.json`` with a Llama-3 style chat
template). Training is deterministic: the same vocabulary size gives
byte-identical files.

Token ids::

    0..4      special tokens (SPECIAL_TOKENS order)
    5..260    the 256 byte symbols of the byte-level alphabet
    261..     BPE merges learned from CORPUS, up to ``vocab_size``
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    START_HEADER_TOKEN,
    END_HEADER_TOKEN,
    EOT_TOKEN,
)

# NOTE: Llama-3 layout: every message is a header plus content closed by
# <|eot_id|>; the prompt starts with BOS, so chat requests must not add it again.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

CORPUS: tuple[str, ...] = (
    "The prefill engine reads the whole prompt at once and writes the key and value cache.",
    "The decode engine produces one token at a time and reads every cached key and value.",
    "A block holds the keys and values of a fixed number of tokens for every layer.",
    "When the prompt is long, moving the cache is cheaper than computing it again.",
    "The router pairs each request with a prefill engine and a decode engine.",
    "Chunks are packed from paged blocks into contiguous memory and pushed to the peer.",
    "A checksum travels with every chunk, so bytes that arrive damaged are never used.",
    "If a transfer does not finish in time, the decoder computes the prompt itself.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Once upon a time there was a small town by the sea where the wind never stopped.",
    "She opened the window, looked at the rain, and decided to stay home and read.",
    "He wrote a letter to his brother about the weather, the harvest and the new road.",
    "Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 42, 128, 256 and 4096 appear.",
    "What is the capital of France? Paris is the capital of France.",
    "How many legs does a spider have? A spider has eight legs.",
    "Please summarize the following text in one short sentence.",
    "Translate to French: good morning, thank you, see you tomorrow.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    '{"name": "fabric", "version": 1, "layers": [0, 1, 2, 3], "ok": true}',
    "The user asked a question and the assistant gave a helpful, honest answer.",
    "Memory bandwidth, not arithmetic, limits how fast a small model can decode.",
    "Every process that a test starts is stopped by its process id when it ends.",
    "Rivers run to the sea, mountains rise to the sky, and the seasons turn.",
    "In the morning the market is busy; by the evening the streets are quiet again.",
    "Water boils at one hundred degrees Celsius at the level of the sea.",
    "Light travels faster than sound, which is why we see lightning before thunder.",
    "A good test asserts on what users see: the tokens, the error, the metric.",
)


def train_tokenizer(vocab_size: int) -> Any:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` on CORPUS.

    The tokenizer adds BOS in front of every encoded sequence (as Llama-3's
    does) and decodes bytes back to text losslessly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # NOTE: repeating the corpus keeps rare pairs above min_frequency.
    tokenizer.train_from_iterator(list(CORPUS) * 4, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A",
                pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def special_token_ids(tokenizer: Any) -> dict[str, int]:
    """Map each special token to its id in ``tokenizer``."""
    return {token: int(tokenizer.token_to_id(token)) for token in SPECIAL_TOKENS}


def tokenizer_config(tokenizer: Any, model_max_length: int) -> dict[str, Any]:
    """The ``tokenizer_config.json`` content that makes transformers load a fast tokenizer."""
    ids = special_token_ids(tokenizer)
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token, token_id in ids.items()
        },
    }


def write_tokenizer(out_dir: Path, vocab_size: int, model_max_length: int) -> dict[str, int]:
    """Train and write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``.

    Returns the special token ids, for the model's config.
    """
    tokenizer = train_tokenizer(vocab_size)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=False)
    config = tokenizer_config(tokenizer, model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return special_token_ids(tokenizer)
