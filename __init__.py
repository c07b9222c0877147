"""rlstage: RL post-training of language models as a Prefect workflow of Parquet-backed stages on Ray.

The repository's top-level folders are this package's parts (pyproject.toml maps them): ``rlstage.schemas``
(contracts), ``rlstage.engines`` (compute, free of Prefect), ``rlstage.workers`` (Ray roles),
``rlstage.tasks`` (one Prefect task per stage), ``rlstage.flows`` (flows and the CLI) and ``rlstage.infra``
(store, tracking, Ray and Prefect bootstrap).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rlstage")
except PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"
