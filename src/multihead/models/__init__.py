"""Models built on multihead's attention: GPT-2 family, encoder-decoder
Transformer, and the BERT encoder that runs the pretrained MiniLM;
``load_model(path)`` opens any model folder multihead writes (a GPT
checkpoint or a sentence encoder, as ``multihead prune`` and ``multihead
convert`` save them)."""

from .bert import BERT_PRESETS, BertConfig, BertEncoder
from .checkpoint import load_checkpoint, save_checkpoint
from .copy_task import copy_task_batches
from .gpt import GPT, GPT_PRESETS, GPTConfig
from .gpt_inputs import LMOutput
from .minilm import (
    MissingWeightsPackageError,
    SentenceEncoder,
    load_minilm,
    load_sentence_encoder,
    save_sentence_encoder,
)
from .quantize import QuantizedGPT, quantize_weights, weight_format
from .saved import load_model, saved_kind
from .transformer import PRESETS as TRANSFORMER_PRESETS
from .transformer import Transformer, TransformerConfig

__all__ = [
    "GPT",
    "GPTConfig",
    "GPT_PRESETS",
    "LMOutput",
    "quantize_weights",
    "QuantizedGPT",
    "weight_format",
    "save_checkpoint",
    "load_checkpoint",
    "Transformer",
    "TransformerConfig",
    "TRANSFORMER_PRESETS",
    "copy_task_batches",
    "BertEncoder",
    "BertConfig",
    "BERT_PRESETS",
    "load_minilm",
    "SentenceEncoder",
    "MissingWeightsPackageError",
    "save_sentence_encoder",
    "load_sentence_encoder",
    "load_model",
    "saved_kind",
]
