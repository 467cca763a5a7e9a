"""The software and devices a run ran on, recorded beside its config.

A number is only reproducible with the versions that made it:
``train.train_and_evaluate`` writes :func:`versions` to ``versions.json`` in
the workdir each time it writes ``config.json``. ``constraints.txt`` pins the
same packages for ``make``.
"""

import importlib.metadata
import json
import os
import platform

import jax

# The distributions whose versions a run's numbers depend on.
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
VERSIONS_FILE = "versions.json"


def versions() -> dict[str, str | int]:
    """Python's and each of ``PACKAGES``' version, and JAX's backend, device
    kind and device count.

    Examples:
        >>> record = versions()
        >>> record["jax"] == jax.__version__
        True
        >>> sorted(record)  # doctest: +NORMALIZE_WHITESPACE
        ['backend', 'device_count', 'device_kind', 'flax', 'jax', 'jaxlib',
         'numpy', 'optax', 'orbax-checkpoint', 'python']
    """
    record = {"python": platform.python_version()}
    record.update({name: importlib.metadata.version(name) for name in PACKAGES})
    record.update(
        backend=jax.default_backend(),
        device_kind=jax.devices()[0].device_kind,
        device_count=jax.device_count(),
    )
    return record


def write_versions(workdir: str) -> None:
    """Writes :func:`versions` to ``workdir/versions.json``."""
    with open(os.path.join(workdir, VERSIONS_FILE), "w") as f:
        json.dump(versions(), f, indent=2)
