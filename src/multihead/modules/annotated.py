"""Former home of the Annotated Transformer replica; the code lives in ``multihead.textbook.annotated``."""

from ..textbook.annotated import MASK_FILL as MASK_FILL
from ..textbook.annotated import MultiHeadedAttention, attention, clones, subsequent_mask

__all__ = ["MultiHeadedAttention", "subsequent_mask", "clones", "attention"]
