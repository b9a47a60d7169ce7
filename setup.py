"""Packaging for megatron-mecefo."""

from setuptools import find_packages, setup

setup(
    name="megatron-mecefo",
    version="0.1.0",
    description="MeCeFO fault-tolerant training plugin for Megatron-Core (3D parallel).",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_mecefo", "megatron_mecefo.*"]),
    # --mecefo-policy auto's default cost profile (read from the package, not the cwd).
    package_data={"megatron_mecefo.planner": ["default_profile.json"]},
    # Tested: megatron-core 0.16.1 (CPU, Python 3.11); the code also follows the 0.19 API.
    # Install torch first and pin it: an unpinned torch pulls the CUDA build.
    # The etcd client is core: the sbatch scripts launch --store-mode etcd from three nodes
    # on, and a launch must never miss what it uses. The recovery control plane on etcd v3
    # (recovery/etcd_control.py) talks etcd's gRPC API through etcd-sdk-python's stubs
    # (chosen over etcd3gw by benchmarks/etcd_client.py); its generated code needs protobuf
    # >= 5.27.2, which it does not declare.
    install_requires=[
        "torch>=2.6", "megatron-core>=0.16.1", "numpy", "psutil", "etcd-sdk-python>=0.0.7",
        "protobuf>=5.27.2",
    ],  # fmt: skip
    extras_require={
        # The tests also run Megatron-LM's own pretrain_gpt.py (its megatron/training needs
        # what the megatron-lm extra lists).
        "test": [
            "pytest>=8", "pytest-timeout", "tensorboard", "zfec>=1.5", "pyeclib>=1.6",
            "six", "regex", "pyyaml", "pydantic",
        ],  # fmt: skip
        # Kept so that an install line that names it still works: the etcd client is core now.
        "etcd": [],
        # In-memory snapshots' Reed-Solomon parity (m >= 2): zfec, the fastest measured here
        # (benchmarks/snapshot_overhead.py); pyeclib (its wheel bundles ISA-L) the alternative.
        "snapshot": ["zfec>=1.5", "pyeclib>=1.6"],
        "plot": ["matplotlib"],
        # The docs site (`make docs`: MkDocs, the Material theme, the API reference from the
        # docstrings); exact pins, so `mkdocs build --strict` sees the same checks everywhere.
        "docs": [
            "mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings==1.0.8",
            "mkdocstrings-python==2.0.11",
        ],  # fmt: skip
        "tensorboard": ["tensorboard"],
        # benchmarks/goodput.py's torchft peer (Lighthouse, Manager, ProcessGroupGloo on CPU).
        # `make bench-goodput` installs it into its own .venv-tft (see docs/results.md).
        "torchft": ["torchft==0.2.0"],
        # What Megatron-LM's megatron/training imports beyond megatron-core, for running the
        # patched pretrain_gpt.py (patches/).
        "megatron-lm": ["six", "regex", "pyyaml", "pydantic"],
        # GPU machines only: Transformer Engine breaks `import megatron.core` on a CPU torch.
        # NVIDIA apex is not on PyPI (PyPI's `apex` is an unrelated package); build it from
        # source if you want it.
        "te": ["transformer-engine[pytorch]"],
    },
)
