"""A word-level tokenizer built locally from the world's vocabulary (nothing is downloaded).

Every text the environment produces is lower-case words and punctuation separated by single spaces,
so a whitespace-split word-level vocabulary covers it exactly and the Search-R1 tags are single
tokens. `WordTokenizer` wraps it (no transformers import) and saves it next to the model, so a
checkpoint directory is a normal Hugging Face model directory.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

PAD, UNK, EOS = "[PAD]", "[UNK]", "[EOS]"
TAGS = ("<search>", "</search>", "<answer>", "</answer>", "<information>", "</information>")
# words the environment itself writes (prompt header, invalid-action message, observation format)
ENV_WORDS = ("question", ":", "doc", "no", "results", ".", "invalid", "action", ",", "use", "search", "or", "answer", "?") + tuple(str(i) for i in range(10))


def build_tokenizer(texts: Iterable[str], extra: Iterable[str] = ()) -> WordTokenizer:
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
    tok.add_special_tokens([PAD, UNK, EOS])  # already in the vocabulary: their ids do not move
    return WordTokenizer(tok)


class WordTokenizer:
    """The built-in world's tokenizer: a `tokenizers` word-level model with the calls the trainer makes, named
    as transformers' PreTrainedTokenizerFast names them (which costs ≈ 1.5 s of start-up to import). It saves
    as tokenizer.json + tokenizer_config.json, which transformers' AutoTokenizer loads as that class."""

    def __init__(self, backend):
        self.backend_tokenizer = backend
        self.pad_token, self.unk_token, self.eos_token = PAD, UNK, EOS
        self.pad_token_id, self.unk_token_id, self.eos_token_id = (backend.token_to_id(t) for t in (PAD, UNK, EOS))
        self.all_special_ids = [self.pad_token_id, self.unk_token_id, self.eos_token_id]

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def save_pretrained(self, out_dir) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.backend_tokenizer.save(str(out / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": PAD, "unk_token": UNK, "eos_token": EOS,
                  "clean_up_tokenization_spaces": False}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_pretrained(cls, path) -> WordTokenizer:
        return cls(Tokenizer.from_file(str(Path(path) / "tokenizer.json")))


def load_tokenizer(path) -> WordTokenizer:
    """The tokenizer saved beside a checkpoint (`save_pretrained`)."""
    return WordTokenizer.from_pretrained(path)
