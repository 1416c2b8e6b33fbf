"""A tiny sentence encoder for tests: random BERT weights and a WordPiece tokenizer trained on a few lines."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from multihead.models.bert import BertConfig, BertEncoder
from multihead.models.minilm import SentenceEncoder, save_sentence_encoder

LINES = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer",
         "The slings and arrows of outrageous fortune,", "Or to take arms against a sea of troubles",
         "Now is the winter of our discontent made glorious summer", "my kingdom for a horse"] * 5  # fmt: skip


def wordpiece(vocab_size: int = 300) -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(LINES, trainers.WordPieceTrainer(vocab_size=vocab_size, show_progress=False,
                            special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))  # fmt: skip
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def tiny_encoder(seed: int = 0) -> SentenceEncoder:
    """2 layers x 4 heads, width 24, positions up to 64, mean pooling, L2-normalised (eval mode)."""
    torch.manual_seed(seed)
    tok = wordpiece()
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=24, num_layers=2, num_heads=4,
                        intermediate_size=40, max_position_embeddings=64)  # fmt: skip
    return SentenceEncoder(BertEncoder(config).eval(), tok, max_seq_length=64, pooling="mean", normalize=True).eval()


def save_tiny_encoder(folder: Path, seed: int = 0) -> Path:
    """``tiny_encoder`` saved with ``save_sentence_encoder`` (what prune and convert write)."""
    return save_sentence_encoder(tiny_encoder(seed), folder)
