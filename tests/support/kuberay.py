"""A JSON Schema of the KubeRay resources `deploy/` uses (``ray.io/v1`` RayCluster and RayJob),
for tests/test_deploy.py. No package ships KubeRay's CRDs, so this is written here from KubeRay's
API types (``ray-operator/apis/ray/v1``): every field of a RayCluster's and a RayJob's spec, its
type, and which are required; an unknown field is an error, as the API server's structural
schema prunes or rejects it. Kubernetes' own types inside (pod templates, a Service, resource
requirements) are objects here: the pod templates are checked against Kubernetes' schemas by
the test itself.
"""

from __future__ import annotations

from typing import Any

_STRING = {"type": "string"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_NUMBER = {"type": "number"}
_OBJECT = {"type": "object"}  # a Kubernetes type, checked elsewhere or not at all
_STRING_MAP = {"type": "object", "additionalProperties": _STRING}


def _strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


_MANAGED_BY = {"enum": ["ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"]}

_HEAD_GROUP = _strict(
    {
        "template": _OBJECT,
        "headService": _OBJECT,
        "enableIngress": _BOOL,
        "rayStartParams": _STRING_MAP,
        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]},
    },
    required=("template", "rayStartParams"),
)

_WORKER_GROUP = _strict(
    {
        "suspend": _BOOL,
        "groupName": _STRING,
        "replicas": _INT,
        "minReplicas": _INT,
        "maxReplicas": _INT,
        "idleTimeoutSeconds": _INT,
        "rayStartParams": _STRING_MAP,
        "template": _OBJECT,
        "scaleStrategy": _strict({"workersToDelete": {"type": "array", "items": _STRING}}),
        "numOfHosts": _INT,
    },
    required=("groupName", "template", "rayStartParams"),
)

_AUTOSCALER = _strict(
    {
        "resources": _OBJECT,
        "image": _STRING,
        "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        "securityContext": _OBJECT,
        "idleTimeoutSeconds": _INT,
        "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
        "env": {"type": "array", "items": _OBJECT},
        "envFrom": {"type": "array", "items": _OBJECT},
        "volumeMounts": {"type": "array", "items": _OBJECT},
    }
)

_REDIS_CREDENTIAL = _strict({"valueFrom": _OBJECT, "value": _STRING})

RAY_CLUSTER_SPEC = _strict(
    {
        "suspend": _BOOL,
        "managedBy": _MANAGED_BY,
        "autoscalerOptions": _AUTOSCALER,
        "headServiceAnnotations": _STRING_MAP,
        "enableInTreeAutoscaling": _BOOL,
        "gcsFaultToleranceOptions": _strict(
            {
                "redisUsername": _REDIS_CREDENTIAL,
                "redisPassword": _REDIS_CREDENTIAL,
                "externalStorageNamespace": _STRING,
                "redisAddress": _STRING,
            },
            required=("redisAddress",),
        ),
        "headGroupSpec": _HEAD_GROUP,
        "rayVersion": _STRING,
        "workerGroupSpecs": {"type": "array", "items": _WORKER_GROUP},
    },
    required=("headGroupSpec",),
)

RAY_JOB_SPEC = _strict(
    {
        "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
        "backoffLimit": _INT,
        "rayClusterSpec": RAY_CLUSTER_SPEC,
        "submitterPodTemplate": _OBJECT,
        "metadata": _STRING_MAP,
        "clusterSelector": _STRING_MAP,
        "submitterConfig": _strict({"backoffLimit": _INT}),
        "managedBy": _MANAGED_BY,
        "deletionPolicy": {"enum": ["DeleteCluster", "DeleteWorkers", "DeleteSelf", "DeleteNone"]},
        "entrypoint": _STRING,
        "runtimeEnvYAML": _STRING,
        "jobId": _STRING,
        "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode"]},
        "entrypointResources": _STRING,
        "entrypointNumCpus": _NUMBER,
        "entrypointNumGpus": _NUMBER,
        "ttlSecondsAfterFinished": _INT,
        "shutdownAfterJobFinishes": _BOOL,
        "suspend": _BOOL,
    }
)


def resource_schema(kind: str) -> dict[str, Any]:
    """The schema of a whole ``ray.io/v1`` ``kind`` (metadata: an object, checked elsewhere)."""
    spec = {"RayCluster": RAY_CLUSTER_SPEC, "RayJob": RAY_JOB_SPEC}[kind]
    return _strict(
        {
            "apiVersion": {"const": "ray.io/v1"},
            "kind": {"const": kind},
            "metadata": _OBJECT,
            "spec": spec,
        },
        required=("apiVersion", "kind", "metadata", "spec"),
    )
