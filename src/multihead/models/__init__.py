"""Models built on multihead's attention: GPT-2 family, encoder-decoder
Transformer, and the BERT encoder that runs the pretrained MiniLM."""

from .bert import BERT_PRESETS, BertConfig, BertEncoder
from .checkpoint import load_checkpoint, save_checkpoint
from .gpt import GPT, GPT_PRESETS, GPTConfig
from .gpt_inputs import LMOutput
from .minilm import MissingWeightsPackageError, SentenceEncoder, load_minilm
from .transformer import PRESETS as TRANSFORMER_PRESETS
from .transformer import Transformer, TransformerConfig, copy_task_batches

__all__ = [
    "GPT",
    "GPTConfig",
    "GPT_PRESETS",
    "LMOutput",
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
]
