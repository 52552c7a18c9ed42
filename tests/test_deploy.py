"""deploy/: the manifests match Kubernetes' own API schemas (and Ray's, for the launcher config),
name the image the Dockerfile documents, run a valid `hpsweep run`, ask for no more than a pod
offers or the database allows, and the storage proxy's command serves a study from PostgreSQL.

The schemas come with packages, so this runs offline: `kubernetes-validate` bundles Kubernetes'
(every built-in kind, strict: an unknown field is an error), Ray bundles its launcher's. No
package ships KubeRay's CRDs: a RayCluster or RayJob is checked against `support.kuberay`'s
schema of KubeRay's API types, and its metadata and pod templates against Kubernetes' PodTemplate.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import optuna
import pytest
import yaml
from support import free_port
from support.kuberay import resource_schema
from support.postgres import PASSWORD, postgres_server

from hpsweep.cli.commands import STORAGE_ENV, build_parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
IMAGE = re.compile(r"^[\w.-]+(?::\d+)?(/[\w.-]+)*/hpsweep-ray:(?P<version>\d+\.\d+\.\d+)(-cuda)?$")
#: The oldest Kubernetes the manifests are for (the Job's fields: README) and the newest bundled.
K8S_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())
KUBERAY_KINDS = ("RayCluster", "RayJob")
KUBERNETES_FILES = (
    "kuberay-raycluster.yaml",
    "kuberay-rayjob.yaml",
    "k8s-optuna-secrets.yaml",
    "k8s-optuna-postgres.yaml",
    "k8s-optuna-workers.yaml",
    "k8s-optuna-storage-proxy.yaml",
)


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


def _kind(name: str, kind: str) -> dict:
    return next(d for d in _docs(name) if d["kind"] == kind)


def _container(name: str, kind: str) -> dict:
    """The (first) container of the pod template of the ``kind`` object in ``name``."""
    return _kind(name, kind)["spec"]["template"]["spec"]["containers"][0]


def _plain_env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def _images(node: object) -> list[str]:
    if isinstance(node, dict):
        found = [node["image"]] if isinstance(node.get("image"), str) else []
        return found + [i for v in node.values() for i in _images(v)]
    if isinstance(node, list):
        return [i for v in node for i in _images(v)]
    return []


def _cpus(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if str(quantity).endswith("m") else float(quantity)


def _project_version() -> str:
    text = (DEPLOY.parent / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


# --- schemas ------------------------------------------------------------------------------------


def _ray_spec(cr: dict) -> dict:
    """The RayCluster spec of a RayCluster, or the one a RayJob starts."""
    return cr["spec"].get("rayClusterSpec", cr["spec"])


def _pod_templates(cr: dict) -> dict[str, dict]:
    """Each pod template inside a KubeRay CR, by its path in the CR."""
    spec, at = (
        (cr["spec"]["rayClusterSpec"], "spec.rayClusterSpec")
        if "rayClusterSpec" in cr["spec"]
        else (cr["spec"], "spec")
    )
    found = {f"{at}.headGroupSpec.template": spec["headGroupSpec"]["template"]}
    for i, group in enumerate(spec.get("workerGroupSpecs", [])):
        found[f"{at}.workerGroupSpecs.{i}.template"] = group["template"]
    if "submitterPodTemplate" in cr["spec"]:
        found["spec.submitterPodTemplate"] = cr["spec"]["submitterPodTemplate"]
    return found


def schema_check(doc: dict) -> list[str]:
    """What each Kubernetes version in `K8S_VERSIONS` finds wrong in ``doc`` (empty: nothing),
    one line per problem with its path in ``doc``. A built-in kind is checked whole; a KubeRay CR
    as Kubernetes PodTemplates made of its metadata and each pod template inside. A kind with no
    schema at all raises (SchemaNotFoundError): nothing goes unchecked without a word."""
    name = f"{doc['kind']} {doc['metadata']['name']}"
    if doc["kind"] not in KUBERAY_KINDS:
        objects = {"": doc}
        kuberay: list[str] = []
    else:
        kuberay = [
            f"{name}: {path} (KubeRay ray.io/v1): {message}" for path, message in _kuberay(doc)
        ]
        objects = {
            at: {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": doc["metadata"],
                "template": t,
            }
            for at, t in _pod_templates(doc).items()
        }
    return kuberay + [
        f"{name}: {path} (Kubernetes {version}): {message}"
        for at, obj in objects.items()
        for version in K8S_VERSIONS
        for path, message in _validate(obj, version, at)
    ]


def _kuberay(cr: dict) -> list[tuple[str, str]]:
    """What `support.kuberay`'s schema of KubeRay's ``ray.io/v1`` finds wrong in the CR ``cr``."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(resource_schema(cr["kind"]))
    return [
        (".".join(str(p) for p in error.absolute_path), error.message)
        for error in sorted(validator.iter_errors(cr), key=lambda e: list(e.absolute_path))
    ]


def _validate(obj: dict, version: str, at: str) -> list[tuple[str, str]]:
    """Kubernetes ``version``'s complaint about ``obj`` as (path, message); a PodTemplate's path
    ``template.x`` is reported as ``at.x``, where the template sits in the CR."""
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        parts = [str(p) for p in exc.absolute_path]
        if at and parts[:1] == ["template"]:
            parts[0] = at
        return [(".".join(parts), exc.message)]
    return []


@pytest.mark.parametrize("name", KUBERNETES_FILES)
def test_every_manifest_matches_kubernetes_schemas(name: str) -> None:
    for doc in _docs(name):
        assert schema_check(doc) == [], f"{name}: {doc['kind']}"


def _broken_job() -> dict:
    job = copy.deepcopy(_kind("k8s-optuna-workers.yaml", "Job"))
    job["spec"]["parallelism"] = "eight"
    return job


def _broken_raycluster() -> dict:
    cluster = copy.deepcopy(_kind("kuberay-raycluster.yaml", "RayCluster"))
    container = _ray_spec(cluster)["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    container["volumeMount"] = container.pop("volumeMounts")  # a typo an apply would reject
    return cluster


def _broken_rayjob() -> dict:
    job = copy.deepcopy(_kind("kuberay-rayjob.yaml", "RayJob"))
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0][
        "resources"
    ]["limits"] = ["cpu", "2"]
    return job


def _misspelt_worker_groups() -> dict:
    cluster = copy.deepcopy(_kind("kuberay-raycluster.yaml", "RayCluster"))
    cluster["spec"]["workerGroupSpec"] = cluster["spec"].pop("workerGroupSpecs")
    return cluster


def _unquoted_ray_start_param() -> dict:
    job = copy.deepcopy(_kind("kuberay-rayjob.yaml", "RayJob"))
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    return job


@pytest.mark.parametrize(
    "broken, found",
    [
        (_broken_job, "Job hpsweep-optuna-digits: spec.parallelism ("),
        (
            _misspelt_worker_groups,
            "RayCluster hpsweep: spec (KubeRay ray.io/v1): Additional properties are not allowed",
        ),
        (
            _unquoted_ray_start_param,
            "RayJob hpsweep-digits: spec.rayClusterSpec.headGroupSpec.rayStartParams.num-cpus "
            "(KubeRay ray.io/v1): 0 is not of type 'string'",
        ),
        (
            _broken_raycluster,
            "RayCluster hpsweep: spec.workerGroupSpecs.0.template.spec.containers.0 (",
        ),
        (
            _broken_rayjob,
            "RayJob hpsweep-digits: spec.rayClusterSpec.headGroupSpec.template.spec.containers.0"
            ".resources.limits (",
        ),
    ],
    ids=[
        "job-wrong-type",
        "raycluster-misspelt-field",
        "rayjob-unquoted-start-param",
        "raycluster-pod-unknown-field",
        "rayjob-pod-wrong-type",
    ],
)
def test_a_broken_manifest_fails_the_schema_check(broken, found: str) -> None:
    problems = schema_check(broken())
    # one line per Kubernetes version checked, one for KubeRay's schema
    assert len(problems) == (1 if "KubeRay" in found else len(K8S_VERSIONS)), problems
    assert all(found in p for p in problems), problems


def test_the_ray_launcher_config_matches_rays_schema() -> None:
    from jsonschema import ValidationError
    from ray.autoscaler._private.util import prepare_config, validate_config  # as `ray up` does

    config = _docs("ray-cluster.yaml")[0]
    validate_config(prepare_config(copy.deepcopy(config)))
    broken = {**copy.deepcopy(config), "max_worker": 4}  # a typo of max_workers
    with pytest.raises(ValidationError, match="'max_worker' was unexpected"):
        validate_config(prepare_config(broken))


# --- the image ----------------------------------------------------------------------------------


def test_every_manifest_names_the_image_the_dockerfile_builds() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "hpsweep-ray:<hpsweep version>" in dockerfile
    assert '".[ray,postgres,s3]"' in dockerfile and "USER ray" in dockerfile
    torch = re.search(r"^ARG TORCH_VERSION=(\S+)", dockerfile, re.M).group(1)
    assert torch == "2.13.0" and "download.pytorch.org/whl/cpu" in dockerfile
    ray_base = re.search(r"^FROM rayproject/ray:(\d+\.\d+\.\d+)", dockerfile, re.M).group(1)
    images = [i for name in (*KUBERNETES_FILES, "ray-cluster.yaml") for i in _images(_docs(name))]
    assert len(images) >= 6
    for image in set(images) - {"postgres:16"}:
        match = IMAGE.match(image)
        assert match, f"{image} does not follow <registry>/hpsweep-ray:<version>[-cuda]"
        assert match["version"] == _project_version()
    for name in ("kuberay-raycluster.yaml", "kuberay-rayjob.yaml"):
        cluster = next(d for d in _docs(name) if d["kind"] in KUBERAY_KINDS)
        assert _ray_spec(cluster)["rayVersion"] == ray_base  # the operator and the image agree


def test_the_optuna_pods_run_as_a_user_not_root() -> None:
    # (the Ray pods run the image's own user, ray: KubeRay starts Ray in the image as it is)
    for name in KUBERNETES_FILES:
        for doc in _docs(name):
            if "template" in doc.get("spec", {}) and doc["kind"] not in KUBERAY_KINDS:
                assert doc["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"], name


# --- Optuna workers on Kubernetes ---------------------------------------------------------------


def _worker() -> tuple[dict, dict, argparse.Namespace]:
    """The workers' Job, its container, and its command as `hpsweep run` parses it."""
    job = _kind("k8s-optuna-workers.yaml", "Job")
    container = _container("k8s-optuna-workers.yaml", "Job")
    assert container["command"][:2] == ["hpsweep", "run"], container["command"]
    return job, container, build_parser().parse_args(container["command"][1:])


def test_the_workers_job_runs_hpsweep_against_the_database_and_s3() -> None:
    job, container, ns = _worker()
    assert ns.backend == "optuna" and ns.storage is None  # the study's URL: HPSWEEP_STORAGE
    assert ns.study_name and ns.output_dir.startswith("s3://") and ns.n_trials > 0
    assert (DEPLOY.parent / "search_spaces" / Path(ns.space_file).name).exists()
    assert Path(ns.space_file).parent == Path("/home/ray/sweeps")  # where the image has them
    env = {e["name"]: e for e in container["env"]}
    assert env[STORAGE_ENV]["valueFrom"]["secretKeyRef"] == {
        "name": "hpsweep-db",
        "key": "storage-url",
    }
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "hpsweep-s3", "key": key}
    assert env["AWS_ENDPOINT_URL"]["valueFrom"]["secretKeyRef"]["optional"] is True


def test_a_lost_worker_pod_is_replaced() -> None:
    spec = _worker()[0]["spec"]
    assert spec["parallelism"] == spec["completions"] and spec["completionMode"] == "Indexed"
    assert (
        spec["template"]["spec"]["restartPolicy"] == "Never" and spec["backoffLimitPerIndex"] >= 1
    )
    ignored = [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "Ignore"]
    assert {"type": "DisruptionTarget", "status": "True"} in ignored[0]["onPodConditions"]
    assert ignored[1]["onExitCodes"]["values"] == [143]  # SIGTERM: stopped, not failed
    # Not even exit 2 ends the Job at once: a database still starting up is one too.
    assert not [r for r in spec["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]


def test_every_secret_a_pod_reads_is_in_the_template() -> None:
    secrets = {s["metadata"]["name"]: s["stringData"] for s in _docs("k8s-optuna-secrets.yaml")}
    text = "\n".join((DEPLOY / n).read_text() for n in KUBERNETES_FILES if "optuna" in n)
    refs = re.findall(r"secretKeyRef: \{name: ([\w-]+), key: (\w[\w-]*)(, optional: true)?\}", text)
    assert len(refs) >= 6
    for name, key, optional in refs:
        assert optional or key in secrets[name], (name, key)


def _max_connections() -> int:
    postgres = _kind("k8s-optuna-postgres.yaml", "StatefulSet")["spec"]["template"]["spec"]
    args = postgres["containers"][0]["args"]
    return int(args[args.index("-c") + 1].removeprefix("max_connections="))


def test_the_workers_connections_fit_the_database() -> None:
    job, _, ns = _worker()
    usable = _max_connections() - 3  # PostgreSQL keeps 3 for superusers by default
    assert job["spec"]["parallelism"] * ns.n_jobs <= usable  # one per worker process
    proxy = _kind("k8s-optuna-storage-proxy.yaml", "Deployment")["spec"]
    threads = int(
        _plain_env(_container("k8s-optuna-storage-proxy.yaml", "Deployment"))["PROXY_THREADS"]
    )
    assert proxy["replicas"] * threads <= usable  # one per proxy thread


def test_the_workers_trials_fit_their_pod() -> None:
    job, container, ns = _worker()
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert ns.n_jobs * ns.resources_per_trial["cpu"] <= _cpus(limits["cpu"])
    assert limits["memory"] == requests["memory"]  # no OOM kill for using what was asked for


def _wait_for_port(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError("the storage proxy did not listen within 60 s")


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
def test_the_storage_proxy_serves_the_study_from_postgresql() -> None:
    """The Deployment's own command, with the manifest's settings but a local port and database."""
    container = _container("k8s-optuna-storage-proxy.yaml", "Deployment")
    command = container["command"]
    assert command[:2] == ["python", "-c"]
    secret = {"name": "hpsweep-db", "key": "database-url"}
    assert {"name": "OPTUNA_STORAGE", "valueFrom": {"secretKeyRef": secret}} in container["env"]
    port = free_port()
    with postgres_server() as postgres:
        env = {**os.environ, **_plain_env(container), "OPTUNA_STORAGE": postgres.url()}
        env.update(PROXY_HOST="127.0.0.1", PROXY_PORT=str(port))
        proxy = subprocess.Popen(
            [sys.executable, *command[1:]],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_for_port(port, proxy)
            through_proxy = optuna.storages.GrpcStorageProxy(host="127.0.0.1", port=port)
            study = optuna.create_study(study_name="proxied", storage=through_proxy)
            study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
            in_database = "SELECT count(*) FROM trials WHERE state = 'COMPLETE'"
            assert postgres.sql(in_database, database="sweeps") == "3"  # through the proxy
        finally:
            proxy.terminate()
            output = proxy.communicate(timeout=30)[0].decode()
    assert PASSWORD not in output


# --- Ray ----------------------------------------------------------------------------------------


def _entrypoint_args() -> list[str]:
    job = _kind("kuberay-rayjob.yaml", "RayJob")
    words = shlex.split(job["spec"]["entrypoint"])
    assert words[:2] == ["hpsweep", "run"], words
    return words[1:]


def test_rayjob_entrypoint_is_a_valid_hpsweep_run_on_the_ray_backend() -> None:
    ns = build_parser().parse_args(_entrypoint_args())
    assert ns.command == "run" and ns.backend == "ray" and ns.address == "auto"
    assert ns.scheduler in ("fifo", "asha", "hyperband", "pbt") and ns.sampler in ("random", "tpe")
    assert ns.output_dir.startswith("/mnt/sweeps/")  # on the volume every pod mounts
    # the head offers no CPUs: trials run on workers, so Ray's storage is where every pod reaches
    assert ns.storage.startswith(("/mnt/sweeps/", "s3://"))
    # where the Dockerfile copies space files
    assert Path(ns.space_file).parent == Path("/home/ray/sweeps")
    assert (DEPLOY.parent / "search_spaces" / Path(ns.space_file).name).exists()


def test_resources_per_trial_fit_the_workers() -> None:
    ns = build_parser().parse_args(_entrypoint_args())
    per_trial = {"cpu": 1.0, "gpu": 0.0, **ns.resources_per_trial}
    spec = _kind("kuberay-rayjob.yaml", "RayJob")["spec"]["rayClusterSpec"]
    total_slots = 0
    for group in spec["workerGroupSpecs"]:
        ray_cpus = float(group["rayStartParams"]["num-cpus"])
        container = group["template"]["spec"]["containers"][0]
        # Ray offers no more than the pod has
        assert ray_cpus <= _cpus(container["resources"]["limits"]["cpu"])
        gpus = float(container["resources"]["limits"].get("nvidia.com/gpu", 0))
        assert per_trial["cpu"] <= ray_cpus and per_trial["gpu"] <= max(
            gpus, per_trial["gpu"] if gpus else 0
        )
        total_slots += int(ray_cpus // per_trial["cpu"]) * group["replicas"]
    assert ns.n_jobs <= total_slots  # --n-jobs trials can all run at once
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"

    launcher = _docs("ray-cluster.yaml")[0]
    workers = [
        t
        for name, t in launcher["available_node_types"].items()
        if name != launcher["head_node_type"]
    ]
    assert all(per_trial["cpu"] <= t["resources"]["CPU"] for t in workers)
    assert launcher["docker"]["image"] == group["template"]["spec"]["containers"][0]["image"]


def test_every_pod_mounts_the_shared_sweep_volume() -> None:
    for name in ("kuberay-raycluster.yaml", "kuberay-rayjob.yaml"):
        cluster = next(d for d in _docs(name) if d["kind"] in KUBERAY_KINDS)
        spec = _ray_spec(cluster)
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            mounts = group["template"]["spec"]["containers"][0]["volumeMounts"]
            assert {"name": "sweeps", "mountPath": "/mnt/sweeps"} in mounts
    claim = _kind("kuberay-raycluster.yaml", "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_a_failed_mount_stops_the_node_loudly() -> None:
    for path in DEPLOY.iterdir():
        assert "|| true" not in path.read_text(), path.name  # no failure swallowed anywhere
    commands = _docs("ray-cluster.yaml")[0]["initialization_commands"]
    mount = next(i for i, c in enumerate(commands) if "mount -t" in c)
    assert commands[mount + 1] == "mountpoint /mnt/sweeps"  # exits 1 when it is not mounted


# --- the walk-through ---------------------------------------------------------------------------


def test_readme_walks_from_zero_to_a_sweep() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for step in (
        "docker build",
        "ray up",
        "kubectl apply",
        "kubectl create secret",
        "hpsweep run",
        "--address",
        "shared",
        "--resume",
        "HPSWEEP_STORAGE",
        "grpc://hpsweep-storage-proxy:13000",
        "max_connections",
        "M*N",
        "not schema-checked",
    ):
        assert step in readme, step
