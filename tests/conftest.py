"""Test-wide settings."""

import os

# Triton picks interpreter or compiler when a kernel is decorated, so this must be set
# before any module that defines kernels is imported. Without a GPU the kernels run in the
# interpreter (small shapes); with one they compile and run natively.
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
