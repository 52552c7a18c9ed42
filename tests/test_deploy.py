"""deploy/: the manifests match Kubernetes' own API schemas (and Ray's, for the launcher config),
name the image the Dockerfile documents (built from the project's own extras), run a valid
`hpsweep run`, ask for no more than a pod offers or the database allows, stage checkpoints on the
pod's scratch volume, end the workers' Job at once on a user's mistake (exit 2) but not on a
preemption, and the storage proxy's command serves a study from PostgreSQL (one proxy at a time).

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
import tomllib
import yaml
from support import free_port
from support.kuberay import resource_schema
from support.postgres import PASSWORD, postgres_server

from hpsweep.cli.commands import STORAGE_ENV, build_parser
from hpsweep.runs.home import RemoteHome

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


def _bytes(quantity: str) -> int:
    """A Kubernetes storage quantity (``20Gi``, ``512M``, ``1000``) in bytes."""
    number, unit = re.fullmatch(r"(\d+)([KMGT]i?)?", str(quantity)).groups()
    base = 1024 if unit and unit.endswith("i") else 1000
    return int(number) * base ** (" KMGT".index(unit[0]) if unit else 0)


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
    assert "hpsweep-ray:<hpsweep version>" in dockerfile and "USER ray" in dockerfile
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


def _pip_installs(dockerfile: str) -> list[str]:
    """What each ``pip install`` in ``dockerfile``'s RUN lines installs (its options left out)."""
    with_values = {"--index-url", "--extra-index-url", "--constraint", "-c", "-r"}
    found = []
    for line in dockerfile.replace("\\\n", " ").splitlines():
        for command in line.removeprefix("RUN ").split("&&") if line.startswith("RUN ") else []:
            words = shlex.split(command)
            if words[:2] != ["pip", "install"]:
                continue
            skip = False
            for word in words[2:]:
                if not skip and not word.startswith("-"):
                    found.append(word)
                skip = word in with_values
    return found


def _image_install_problems(dockerfile: str) -> list[str]:
    """What is wrong with how ``dockerfile`` installs hpsweep: an extra that pyproject.toml does
    not declare, one that the manifests need missing, or a package an extra brings installed
    beside it with a version of its own (anything else is a core dependency, torch)."""
    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]
    declared = project["optional-dependencies"]
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.M))
    installs = [re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], r) for r in _pip_installs(dockerfile)]
    ours = [r for r in installs if r.startswith(".[")]
    if len(ours) != 1:
        return [f"hpsweep is installed {len(ours)} times: {installs}"]
    extras = set(ours[0][2:-1].split(","))
    # Ray's nodes, the study's database, the S3 home, the storage proxy and its clients
    problems = [f"no extra {e!r} in pyproject.toml" for e in sorted(extras - set(declared))]
    problems += [f"no extra {e!r}" for e in ("ray", "postgres", "s3", "grpc") if e not in extras]
    in_extras = {_name(r): e for e, reqs in declared.items() for r in reqs}
    for r in set(installs) - set(ours):
        if _name(r) in in_extras or _name(r) not in {_name(d) for d in project["dependencies"]}:
            problems.append(f"{r} beside the extras (the {in_extras.get(_name(r))!r} extra)")
    return problems


def test_the_image_installs_the_projects_own_extras() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert _image_install_problems(dockerfile) == []
    loose = dockerfile.replace('".[${EXTRAS}]"', '".[${EXTRAS},gpu]" "grpcio>=1.42"')
    assert _image_install_problems(loose) == [
        "no extra 'gpu' in pyproject.toml",
        "grpcio>=1.42 beside the extras (the 'grpc' extra)",
    ]


def _name(requirement: str) -> str:
    """A requirement's package name, as pip compares them (``grpcio>=1.42`` -> ``grpcio``)."""
    name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


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


def _failed_pod(job: dict, exits: dict[str, int], conditions: tuple[str, ...] = ()) -> str:
    """What the Job controller does with a failed pod of ``job`` whose containers exited with
    ``exits`` (name: code) and which holds the True pod ``conditions``: the action of the first
    podFailurePolicy rule that matches (a nonzero code of the named container, or of any, In or
    NotIn the values; or one of the conditions), or "Count" (one of its index's retries)."""
    for rule in job["spec"]["podFailurePolicy"]["rules"]:
        if "onExitCodes" in rule:
            on = rule["onExitCodes"]
            codes = [c for n, c in exits.items() if c and on.get("containerName", n) == n]
            if any((c in on["values"]) == (on["operator"] == "In") for c in codes):
                return rule["action"]
        elif any(
            c["type"] in conditions and c["status"] == "True" for c in rule["onPodConditions"]
        ):
            return rule["action"]
    return "Count"


def test_a_lost_worker_pod_is_replaced_and_a_mistake_ends_the_job() -> None:
    job = _worker()[0]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["parallelism"] == spec["completions"] and spec["completionMode"] == "Indexed"
    # what the API server requires of a podFailurePolicy, beyond the schema
    assert pod["restartPolicy"] == "Never" and spec["backoffLimitPerIndex"] >= 1
    names = {c["name"] for c in pod["containers"] + pod.get("initContainers", [])}
    for codes in [
        r["onExitCodes"] for r in spec["podFailurePolicy"]["rules"] if "onExitCodes" in r
    ]:
        assert codes["containerName"] in names and 0 not in codes["values"], codes
        assert codes["values"] == sorted(set(codes["values"])), codes
    outcomes = {
        "a bad flag or space file": ({"worker": 2}, (), "FailJob"),
        "no database after the wait": ({"wait-for-storage": 2}, (), "FailJob"),
        "a crash": ({"worker": 1}, (), "Count"),
        "an OOM kill": ({"worker": 137}, (), "Count"),
        "SIGTERM: trials recorded as stopped": ({"worker": 143}, (), "Ignore"),
        "preempted, evicted, a lost node": ({"worker": 137}, ("DisruptionTarget",), "Ignore"),
    }
    for case, (exits, conditions, action) in outcomes.items():
        assert _failed_pod(job, exits, conditions) == action, case


def _wait_for_storage(url: str, seconds: str) -> subprocess.Popen:
    """The workers' init container's own command, run here against ``url``."""
    init = _kind("k8s-optuna-workers.yaml", "Job")["spec"]["template"]["spec"]["initContainers"][0]
    assert init["name"] == "wait-for-storage" and init["command"][:2] == ["python", "-c"]
    env = {**os.environ, **_plain_env(init), STORAGE_ENV: url, "STORAGE_WAIT_SECONDS": seconds}
    return subprocess.Popen(
        [sys.executable, *init["command"][1:]],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_worker_waits_for_its_storage_to_accept_connections() -> None:
    port = free_port()
    waiting = _wait_for_storage(f"grpc://127.0.0.1:{port}", "600")
    try:
        told = waiting.stdout.readline()  # written after a first try found nothing listening
        assert f"waiting up to 600 s for the storage at 127.0.0.1:{port}" in told, told
        with socket.create_server(("127.0.0.1", port)):
            assert waiting.wait(timeout=60) == 0
    finally:
        waiting.kill()
        waiting.communicate()


def test_a_storage_that_never_answers_is_one_line_and_exit_2() -> None:
    password = "Zr7-not-for-logs"
    gone = _wait_for_storage(f"postgresql://hpsweep:{password}@127.0.0.1:{free_port()}/db", "1")
    out, err = gone.communicate(timeout=60)
    assert gone.returncode == 2, (out, err)  # FailJob: the test above checks the rule
    assert err.count("\n") == 1 and "hpsweep: error: nothing answered at 127.0.0.1:" in err
    assert "fix the host in the hpsweep-db Secret's storage-url" in err
    assert password not in out + err


def test_the_workers_stage_checkpoints_on_their_scratch_volume(monkeypatch) -> None:
    job, container, ns = _worker()
    pod = job["spec"]["template"]["spec"]
    scratch = {v["name"]: v["emptyDir"] for v in pod["volumes"] if "emptyDir" in v}
    mounts = [Path(m["mountPath"]) for m in container["volumeMounts"] if m["name"] in scratch]
    env = _plain_env(container)
    for name, value in env.items():
        if name != "TMPDIR":  # (this process's own temporary files stay where they are)
            monkeypatch.setenv(name, value)
    # the folder the S3 home writes each checkpoint to before uploading it, as hpsweep finds it
    staging = RemoteHome(ns.output_dir).local
    assert any(staging.is_relative_to(m) for m in mounts), staging
    assert any(Path(env["TMPDIR"]).is_relative_to(m) for m in mounts)
    # the pod's ephemeral-storage covers the scratch volume and the container's own files
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert limits["ephemeral-storage"] == requests["ephemeral-storage"]
    volumes = sum(_bytes(v["sizeLimit"]) for v in scratch.values())
    assert volumes < _bytes(limits["ephemeral-storage"])


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


def test_one_storage_proxy_runs_at_a_time() -> None:
    # the proxy caches the study: an update stops the old pod before the new one starts
    proxy = _kind("k8s-optuna-storage-proxy.yaml", "Deployment")["spec"]
    assert proxy["replicas"] == 1 and proxy["strategy"] == {"type": "Recreate"}


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
        "EXTRAS",
        "FailJob",
        "HPSWEEP_CACHE",
        "Recreate",
    ):
        assert step in readme, step


def test_the_docs_say_how_to_size_the_kubernetes_manifests() -> None:
    docs = (DEPLOY.parent / "docs" / "many-machines.md").read_text()
    section = docs.split("\n### Kubernetes", 1)[1].split("\n## ", 1)[0]
    for name in KUBERNETES_FILES:
        assert name.startswith("kuberay") or f"deploy/{name}" in section, name
    for point in ("--n-jobs", "max_connections", "PROXY_THREADS", "HPSWEEP_CACHE", "FailJob"):
        assert point in section, point
