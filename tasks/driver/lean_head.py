"""A local single-node Ray without the two head processes that have nothing to do there.

`ray.init` of a new node starts, besides the GCS, the raylet and their agents, an autoscaler monitor (a cluster's
scaling loop: one fixed node has nothing to scale) and, with `include_dashboard=False`, a dashboard process that
loads only the usage-stats module (which `RAY_USAGE_STATS_ENABLED=0` turns off). Together ~135 MB of PSS, 4 % of
the demo's peak (bench/pss.py); `ray.init` has no switch for either. While a local Ray starts, `lean_head` makes
the node's two starters do nothing; where this Ray names them otherwise, the node starts as Ray builds it.
Without a dashboard the dashboard agent asks the GCS for its address once a second and logs that it has none
(its own log file only); a cluster started with `ray start` is not touched.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger(__name__)

IDLE_HEAD_STARTERS = ("start_monitor", "start_api_server")


def _skip(self: Any, *args: Any, **kwargs: Any) -> None:
    """Start nothing (the node's dashboard URL stays None, as for a node without one)."""


@contextmanager
def lean_head(include_dashboard: bool | None) -> Iterator[bool]:
    """Within the block a new Ray head node starts no autoscaler monitor and, where `include_dashboard` is False,
    no dashboard process. Yields whether it could (False: this Ray's node has other method names)."""
    try:
        from ray._private.node import Node
    except ImportError:
        yield False
        return
    names = IDLE_HEAD_STARTERS if include_dashboard is False else IDLE_HEAD_STARTERS[:1]
    saved = {name: Node.__dict__.get(name) for name in names}
    if any(method is None for method in saved.values()):
        log.debug("Ray's Node has no %s: the local Ray starts all its head processes", names)
        yield False
        return
    for name in names:
        setattr(Node, name, _skip)
    try:
        yield True
    finally:
        for name, method in saved.items():
            setattr(Node, name, method)
