"""Drop-ins for other libraries' attention modules: ``torch_nn.TorchMultiheadAttention``
for ``torch.nn.MultiheadAttention`` (state aliasing in torch_nn_state.py, torch's
masks in torch_nn_masks.py)."""

from .torch_nn import TorchMultiheadAttention

__all__ = ["TorchMultiheadAttention"]
