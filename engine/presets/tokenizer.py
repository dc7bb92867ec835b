"""A preset's tokenizer and chat templates: a byte-level BPE trained on a few sentences (and made-up words for
real-size vocabularies), and the hub checkpoints' chat templates trimmed to text and images."""

from __future__ import annotations

import random
import string
from typing import Any

# A byte-level BPE is trained on these few sentences: enough merges for readable random text.
_CORPUS = [
    "A person is walking across the street next to a blue bus.",
    "Two men in suits are standing on a football pitch and talking.",
    "The camera shows a woman with a red bag near the entrance.",
    "Describe the image in one sentence. What is the person doing?",
    "User: Describe this frame. Assistant: There are people in the picture.",
    "Nobody is in the room; the lights are on and the door is open.",
    "A cyclist rides past a parked car while a child waits at the corner.",
    "The quick brown fox jumps over the lazy dog 0123456789 times.",
]

# Chat templates of the hub checkpoints, trimmed to text, images and videos.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
LLAVA_ONEVISION_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\n' + content['text'] }}"
    "{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<start_of_image>' }}{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _made_up_text(vocab_size: int) -> list[str]:
    """Lines of random lowercase words, enough distinct ones for `vocab_size` merges (none for small vocabularies,
    which `_CORPUS` alone fills)."""
    if vocab_size <= 1024:
        return []
    rng = random.Random(vocab_size)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(2 * vocab_size)]
    return [" ".join(rng.choices(words, k=40)) for _ in range(vocab_size // 4)]


def train_tokenizer(
    vocab_size: int, special_tokens: list[str], *, eos: str, pad: str, bos: str | None = None, **named: Any
):
    """A byte-level BPE trained on `_CORPUS` (plus made-up words when `vocab_size` asks for more merges than
    those sentences hold), with `special_tokens` first in its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS + _made_up_text(vocab_size), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, unk_token=pad, **named
    )
