"""megatron-mecefo: MeCeFO fault-tolerant training for Megatron-Core.

Importing the package is cheap: it does not import torch or megatron-core. Submodules do.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
