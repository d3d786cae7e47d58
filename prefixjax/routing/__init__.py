"""Replicas behind a router, with exact or approximate cache views.

* :mod:`prefixjax.routing.routers`: the :class:`Router` protocol and the
  registered routers (``round_robin``, ``least_load``, ``cache_aware``,
  ``kv_cost``, ``e2``, ``session_affinity``, ``llm_d``).
* :mod:`prefixjax.routing.cluster`: :func:`simulate_cluster`, ``P``
  replicas of the serving simulator in one jitted loop, and
  :class:`ClusterResult` (metrics per replica and overall).
"""

from prefixjax.routing.cluster import (
  MODES,
  ClusterResult,
  ClusterState,
  simulate_cluster,
)
from prefixjax.routing.routers import (
  ApproxView,
  Router,
  RouteView,
  get_router,
  register_router,
  router_names,
)

__all__ = [
  "MODES",
  "ApproxView",
  "ClusterResult",
  "ClusterState",
  "RouteView",
  "Router",
  "get_router",
  "register_router",
  "router_names",
  "simulate_cluster",
]
