"""deploy/: the manifests parse, name the image the Dockerfile documents, run `hpsweep run`,
and ask per trial for no more than a worker offers."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from hpsweep.cli.commands import build_parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
IMAGE = re.compile(r"^[\w.-]+(?::\d+)?(/[\w.-]+)*/hpsweep-ray:(?P<version>\d+\.\d+\.\d+)(-cuda)?$")


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


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


def test_every_manifest_names_the_image_the_dockerfile_builds() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert (
        "hpsweep-ray:<hpsweep version>" in dockerfile
        and 'pip install --no-cache-dir ".[ray]"' in dockerfile
    )
    ray_base = re.search(r"^FROM rayproject/ray:(\d+\.\d+\.\d+)", dockerfile, re.M).group(1)
    images = [
        i
        for name in ("ray-cluster.yaml", "kuberay-raycluster.yaml", "kuberay-rayjob.yaml")
        for d in _docs(name)
        for i in _images(d)
    ]
    assert images
    for image in images:
        match = IMAGE.match(image)
        assert match, f"{image} does not follow <registry>/hpsweep-ray:<version>[-cuda]"
        assert match["version"] == _project_version()
    for name in ("kuberay-raycluster.yaml", "kuberay-rayjob.yaml"):
        cluster = next(d for d in _docs(name) if d["kind"] in ("RayCluster", "RayJob"))
        spec = cluster["spec"].get("rayClusterSpec", cluster["spec"])
        assert spec["rayVersion"] == ray_base  # the operator and the image agree on Ray's version


def _entrypoint_args() -> list[str]:
    job = next(d for d in _docs("kuberay-rayjob.yaml") if d["kind"] == "RayJob")
    words = shlex.split(job["spec"]["entrypoint"])
    assert words[:2] == ["hpsweep", "run"], words
    return words[1:]


def test_rayjob_entrypoint_is_a_valid_hpsweep_run_on_the_ray_backend() -> None:
    ns = build_parser().parse_args(_entrypoint_args())
    assert ns.command == "run" and ns.backend == "ray" and ns.address == "auto"
    assert ns.scheduler in ("fifo", "asha", "hyperband", "pbt") and ns.sampler in ("random", "tpe")
    assert ns.output_dir.startswith("/mnt/sweeps/")  # on the volume every pod mounts
    # where the Dockerfile copies space files
    assert Path(ns.space_file).parent == Path("/home/ray/sweeps")
    assert (DEPLOY.parent / "search_spaces" / Path(ns.space_file).name).exists()


def test_resources_per_trial_fit_the_workers() -> None:
    ns = build_parser().parse_args(_entrypoint_args())
    per_trial = {"cpu": 1.0, "gpu": 0.0, **ns.resources_per_trial}
    job = next(d for d in _docs("kuberay-rayjob.yaml") if d["kind"] == "RayJob")
    spec = job["spec"]["rayClusterSpec"]
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
        cluster = next(d for d in _docs(name) if d["kind"] in ("RayCluster", "RayJob"))
        spec = cluster["spec"].get("rayClusterSpec", cluster["spec"])
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        for group in groups:
            mounts = group["template"]["spec"]["containers"][0]["volumeMounts"]
            assert {"name": "sweeps", "mountPath": "/mnt/sweeps"} in mounts
    claim = next(
        d for d in _docs("kuberay-raycluster.yaml") if d["kind"] == "PersistentVolumeClaim"
    )
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_readme_walks_from_zero_to_a_sweep() -> None:
    readme = (DEPLOY / "README.md").read_text()
    for step in (
        "docker build",
        "ray up",
        "kubectl apply",
        "hpsweep run",
        "--address",
        "shared",
        "--resume",
    ):
        assert step in readme, step
