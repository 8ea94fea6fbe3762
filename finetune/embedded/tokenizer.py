"""Train a small byte-level BPE tokenizer locally, so nothing is downloaded from a hub.

Byte-level BPE covers every UTF-8 string without an unknown token. Padding has its own token, distinct
from EOS: a tokenizer whose pad token is EOS makes collators mask EOS out of the labels, and the tuned
model then never learns to stop.

Example:
    tokenizer = train_tokenizer(["def f(x):\n    return x\n"] * 100, vocab_size=512)
    tokenizer.save_pretrained("out/")
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")

# Each turn is "<|role|>\n{content}</s>\n". The {% generation %} markers let
# `apply_chat_template(..., return_assistant_tokens_mask=True)` tell which tokens the assistant wrote,
# so chat training can put the loss on those alone (EOS included, so the model learns to stop).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}"
    "{{ message['content'] + eos_token }}"
    "{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, max_model_len: int = 2048) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts`; deterministic for the same texts and vocab size.

    Args:
        texts: training corpus, one document per item.
        vocab_size: target vocabulary size, special tokens included.
        max_model_len: recorded as `model_max_length`.
    """
    specials = [BOS, EOS, PAD, UNK, *ROLE_TOKENS]
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # BOS is prepended when encoding plain text (add_special_tokens=True), EOS is added by the data
    # pipeline where a document ends, so that it is a trained label.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=max_model_len,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
