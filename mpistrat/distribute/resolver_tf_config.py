"""The cluster named by the ``TF_CONFIG`` environment variable, as tf's ``TFConfigClusterResolver``.

The public name is :mod:`mpistrat.cluster_resolver`'s.
"""

from __future__ import annotations

import json
import os
from typing import Any

from mpistrat.distribute.resolver_base import ClusterResolver, ClusterSpec, format_master_url
from mpistrat.errors import ContextError, InvalidArgumentError

__all__ = ["TFConfigClusterResolver"]


def _tf_config() -> dict[str, Any]:
    try:
        config = json.loads(os.environ.get("TF_CONFIG", "{}"))
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise InvalidArgumentError(f"TF_CONFIG must be a JSON object; got {config!r}")
    return config


class TFConfigClusterResolver(ClusterResolver):
    """The cluster described by the ``TF_CONFIG`` environment variable, read at each call, as tf's.

    Arguments given here override ``TF_CONFIG``'s ``task`` and ``rpc_layer``.
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
    ):
        self._task_type, self._task_id = task_type, task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @property
    def task_type(self) -> str | None:
        if self._task_type is not None:
            return str(self._task_type)
        task = _tf_config().get("task", {})
        return str(task["type"]) if "type" in task else None

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        if self._task_id is not None:
            return int(self._task_id)
        task = _tf_config().get("task", {})
        return int(task["index"]) if "index" in task else None

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer if self._rpc_layer is not None else _tf_config().get("rpc_layer")

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    @property
    def environment(self) -> str | None:
        return self._environment

    def cluster_spec(self) -> ClusterSpec:
        config = _tf_config()
        return ClusterSpec(config["cluster"]) if "cluster" in config else ClusterSpec({})

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        session_master = _tf_config().get("session_master")
        if session_master is not None:
            return str(session_master)
        spec = self.cluster_spec()
        if not spec.jobs or (len(spec.jobs) == 1 and len(spec.job_tasks(spec.jobs[0])) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        rpc_layer = rpc_layer if rpc_layer is not None else self.rpc_layer
        if task_type is None or task_id is None:
            raise ContextError(
                "TFConfigClusterResolver.master: TF_CONFIG names no task; pass task_type and task_id"
            )
        return format_master_url(spec.task_address(task_type, task_id), rpc_layer)
