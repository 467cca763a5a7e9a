"""lmhead: the output head of a language model, in JAX and Flax."""

import setuptools

# What the head library (lmhead/*.py, lmhead/decoding/) imports: the whole of
# `pip install lmhead`. The experiment, the service and the study stack are
# extras, so a user of the head functions gets none of them.
CORE = [
    "jax>=0.4.30",
    "flax>=0.8.5",
    "optax>=0.2.3",
    "chex>=0.1.86",
    "absl-py>=2.1",
    "numpy>=1.26",
]
# lmhead.lm: configs, checkpoints, TensorBoard logs, BPE tokenizers,
# Hugging Face checkpoints read as numpy (lmhead/lm/gpt2_import.py), and
# structured output's grammars (lmhead/lm/constraints.py; no dependencies).
LM = [
    "ml-collections>=0.1.1",
    "orbax-checkpoint>=0.5.20",
    "tensorboardX>=2.6",
    "tokenizers>=0.19",
    "safetensors>=0.4",
    "llguidance>=1.9",
]
# lmhead.serve and lmhead.lab import lmhead.lm, so their extras include it.
SERVE = [
    *LM,
    "fastapi>=0.110",
    "pydantic>=2.6",  # the request bodies (lmhead/serve/protocol.py)
    "uvicorn>=0.29",
    "prometheus-client>=0.20",
    "httpx>=0.27",
    "jinja2>=3.1",  # chat templates, rendered as transformers renders them
]
# lmhead.lab's statistics (t quantiles, Holm, TOST, power) and figures, and
# the tying study's reports.
STUDY = [*LM, "scipy>=1.11", "statsmodels>=0.14", "matplotlib>=3.8"]

setuptools.setup(
    name="lmhead",
    version="0.1.0",
    description=(
        "The output head of a language model in JAX/Flax: tied and untied "
        "unembedding, losses, a fused cross-entropy and decoding."
    ),
    packages=setuptools.find_packages(include=["lmhead", "lmhead.*"]),
    python_requires=">=3.11",
    install_requires=CORE,
    extras_require={
        "cuda12": ["jax[cuda12]>=0.4.30"],
        "tpu": ["jax[tpu]>=0.4.30"],
        "lm": LM,
        "serve": SERVE,
        "study": STUDY,
        "dev": [
            "pytest>=8.0",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "nbclient>=0.10",
            "nbformat>=5.10",
            "ipykernel>=6.29",
            "ruff>=0.15",
            "openai>=1.40",
            "jsonschema>=4.20",  # structured output's tests
            "lark>=1.1",
        ],
    },
)
