"""A word-level tokenizer built locally from the world's vocabulary (nothing is downloaded).

Every text the environment produces is lower-case words and punctuation separated by single spaces,
so a whitespace-split word-level vocabulary covers it exactly and the Search-R1 tags are single
tokens. The result is a `transformers.PreTrainedTokenizerFast`, saved next to the model so a
checkpoint directory is a normal Hugging Face model directory.
"""

from __future__ import annotations

from collections.abc import Iterable

PAD, UNK, EOS = "[PAD]", "[UNK]", "[EOS]"
TAGS = ("<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>")
# words the environment itself writes (prompt header, invalid-action message, observation format)
ENV_WORDS = ("question", ":", "doc", "no", "results", ".", "invalid", "action", ",", "use", "search", "or", "answer", "?") + tuple(str(i) for i in range(10))


def build_tokenizer(texts: Iterable[str], extra: Iterable[str] = ()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words: set[str] = set(ENV_WORDS) | set(extra)
    for t in texts:
        words.update(t.split())
    words -= set(TAGS) | {PAD, UNK, EOS}
    vocab = {PAD: 0, UNK: 1, EOS: 2}
    for tag in TAGS:
        vocab[tag] = len(vocab)
    for w in sorted(words):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, unk_token=UNK, eos_token=EOS, clean_up_tokenization_spaces=False
    )
    return fast


def load_tokenizer(path):
    """The tokenizer saved beside a checkpoint (`save_pretrained`)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)
