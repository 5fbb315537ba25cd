"""The batch-job manifests deploy/k8s/tfjob.yaml (Kubeflow TFJob) and jobset.yaml (JobSet),
checked offline: no cluster, no operator.

- Core objects (the state PersistentVolumeClaim) and every pod template inside the custom
  resources: ``kubernetes-validate --strict`` for each of KUBERNETES_VERSIONS (a TFJob replica's
  pod template is checked as a v1 PodTemplate, a JobSet's job template as a batch/v1 Job).
- The custom resources against the API models their projects publish on PyPI (test extra):
  the TFJob against kubeflow-training's ``KubeflowOrgV1TFJob`` (kubeflow.org/v1, generated
  from the training operator's OpenAPI spec), the JobSet against kubeflow-trainer-api's
  ``JobsetV1alpha2JobSet`` (jobset.x-k8s.io/v1alpha2): no unknown field, every value of its
  type, required fields present (tests/api_models.py).
- For every pod, the TF_CONFIG it would get. TFJob: as the training operator writes it
  (kubeflow/training-operator, pkg/controller.v1/tensorflow: genClusterSpec and
  GetPortFromTFJob): ``<job>-<type>-<i>.<namespace>.svc:<port>`` per replica, the port being
  the ``tfjob-port`` of the container named ``tensorflow`` (default 2222), evaluators left out
  of the cluster. JobSet: the pod's env expanded as the kubelet does ($(NAME) from earlier
  variables, fieldRefs from the annotations the Job controller sets), for each pod name
  ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>`` JobSet gives it. Each
  TF_CONFIG must be well formed, name its own pod as its task, and every ps must listen on its
  endpoint's port and the two after it (downpour's port convention).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from api_models import openapi_problems, pydantic_problems
from test_deploy_files import K8S, KUBERNETES_VERSIONS, documents, run, tool

from downpour.config.settings import ConfigError
from downpour.config.tf_config import parse_tf_config, role_settings

pytestmark = pytest.mark.slow

TFJOB = K8S / "tfjob.yaml"
JOBSET = K8S / "jobset.yaml"
TFJOB_MODELS = ("kubeflow.training.models", "kubernetes.client.models")
TFJOB_DEFAULT_PORT = 2222  # tfv1.DefaultPort, when the container names no tfjob-port
COMMAND = ["job", "--model", "downpour.examples.recsys:spec"]
LAYOUT = {"chief": 1, "ps": 2, "worker": 2}  # the job both manifests describe


def custom_resource(path: Path, kind: str) -> dict[str, Any]:
    (doc,) = [d for d in documents(path) if d["kind"] == kind]
    return doc


def models(module: str) -> Any:
    """An API model package of the test extra, or skip saying how to install it."""
    return pytest.importorskip(module, reason=f"{module} not installed: pip install -e '.[test]'")


# ---------------------------------------------------------------- TF_CONFIG


def check_tf_config(text: str) -> dict[str, Any]:
    """The parsed TF_CONFIG, checked as ``downpour job`` checks it (``parse_tf_config``: known
    task types, "host:port" lists, parameter servers, a listed task), and the settings its
    role gets (``role_settings``) pointing at the ps list."""
    parsed = parse_tf_config(text)
    service = {"ps": "server", "worker": "worker"}.get(parsed.task_type)
    if service is not None:
        settings = role_settings(parsed, service)
        if service == "worker":
            assert settings["server"] == ",".join(parsed.cluster["ps"]), settings
        else:
            assert settings["num_shards"] == len(parsed.cluster["ps"]), settings
    return json.loads(text)


def check_pod(tf: dict[str, Any], host: str, container: dict[str, Any]) -> None:
    """``tf`` names this pod (DNS name ``host``) as its task, and the container runs the role
    the way the contract says: ``downpour job``, a ps on its endpoint's port and the next two."""
    task_type, index = tf["task"]["type"], tf["task"]["index"]
    own_host, _, port = tf["cluster"][task_type][index].rpartition(":")
    assert own_host == host, (tf["task"], host)
    assert container["args"][: len(COMMAND)] == COMMAND
    if task_type == "ps":
        base = int(port)
        missing = {base, base + 1, base + 2} - {p["containerPort"] for p in container["ports"]}
        assert not missing, f"ps {index} declares no port {sorted(missing)}"  # rep, push, status
        assert container["startupProbe"]["exec"]["command"][-1] == f"127.0.0.1:{base + 2}"
    if task_type in ("ps", "chief"):  # checkpoints and the export on the job's volume
        args = container["args"]
        root = args[args.index("--state-dir") + 1]
        assert root in {m["mountPath"] for m in container["volumeMounts"]}


def check_job(configs: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> None:
    """Every pod's TF_CONFIG (by DNS name: the config and the container) checked, all with one
    cluster, every task of it run by exactly one pod, in the layout both manifests describe."""
    clusters = set()
    tasks = []
    for host, (tf, container) in configs.items():
        check_pod(tf, host, container)
        clusters.add(json.dumps(tf["cluster"], sort_keys=True))
        tasks.append((tf["task"]["type"], tf["task"]["index"]))
    assert len(clusters) == 1, clusters
    cluster = json.loads(clusters.pop())
    assert sorted(tasks) == sorted(
        (t, i) for t, hosts in cluster.items() for i in range(len(hosts))
    )
    assert {t: len(hosts) for t, hosts in cluster.items()} == LAYOUT


def tfjob_port(replica: dict[str, Any]) -> int:
    """The port the operator writes for a replica type (GetPortFromTFJob)."""
    for container in replica["template"]["spec"]["containers"]:
        if container["name"] == "tensorflow":
            for port in container.get("ports", []):
                if port.get("name") == "tfjob-port":
                    return port["containerPort"]
    return TFJOB_DEFAULT_PORT


def tfjob_configs(job: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Each pod's TF_CONFIG as the training operator builds it, parsed, with its container."""
    name, namespace = job["metadata"]["name"], job["metadata"].get("namespace", "default")
    specs = job["spec"]["tfReplicaSpecs"]

    def host(rtype: str, i: int) -> str:
        return f"{name}-{rtype.lower()}-{i}.{namespace}.svc"

    cluster = {
        rtype.lower(): [f"{host(rtype, i)}:{tfjob_port(spec)}" for i in range(spec["replicas"])]
        for rtype, spec in specs.items()
        if rtype != "Evaluator"
    }
    configs = {}
    for rtype, spec in specs.items():
        (container,) = [
            c for c in spec["template"]["spec"]["containers"] if c["name"] == "tensorflow"
        ]
        for i in range(spec["replicas"]):
            task = {"type": rtype.lower(), "index": i}
            text = json.dumps({"cluster": cluster, "task": task, "environment": "cloud"})
            configs[host(rtype, i)] = (check_tf_config(text), container)
    return configs


REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
FIELD = re.compile(r"^metadata\.(annotations|labels)\['([^']+)'\]$")


def pod_env(container: dict[str, Any], meta: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: fieldRefs read from the pod's
    metadata, $(NAME) replaced by a variable defined before it ($$ is a literal $)."""
    env: dict[str, str] = {}

    def expand(m: re.Match) -> str:
        if m[0] == "$$":
            return "$"
        return env.get(m[1], m[0])

    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = REFERENCE.sub(expand, var["value"])
            continue
        path = var["valueFrom"]["fieldRef"]["fieldPath"]
        if path == "metadata.name":
            env[var["name"]] = meta["name"]
        else:
            m = FIELD.match(path)
            assert m, f"{var['name']}: fieldRef {path} not simulated"
            env[var["name"]] = meta[m[1]][m[2]]
    return env


def jobset_configs(jobset: dict[str, Any]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Each pod's TF_CONFIG from its env as the kubelet expands it, parsed, with its container."""
    name = jobset["metadata"]["name"]
    network = jobset["spec"]["network"]
    assert network["enableDNSHostnames"] is True  # the pod names TF_CLUSTER lists
    subdomain = network.get("subdomain", name)
    configs = {}
    for rjob in jobset["spec"]["replicatedJobs"]:
        job = rjob["template"]["spec"]
        assert job["completionMode"] == "Indexed"  # completion indices 0 .. completions-1
        (container,) = job["template"]["spec"]["containers"]
        for job_index in range(rjob.get("replicas", 1)):
            for pod_index in range(job["completions"]):
                hostname = f"{name}-{rjob['name']}-{job_index}-{pod_index}"
                index = {
                    "batch.kubernetes.io/job-completion-index": str(pod_index),
                    "jobset.sigs.k8s.io/job-index": str(job_index),
                    "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                }
                meta = {"name": f"{hostname}-x7k2p", "annotations": index, "labels": index}
                env = pod_env(container, meta)
                tf = check_tf_config(env["TF_CONFIG"])
                assert tf["task"]["type"] == rjob["name"]
                configs[f"{hostname}.{subdomain}"] = (tf, container)
    return configs


def test_every_tfjob_pod_gets_a_tf_config_naming_itself_and_the_job() -> None:
    check_job(tfjob_configs(custom_resource(TFJOB, "TFJob")))


def test_every_jobset_pod_builds_a_tf_config_naming_itself_and_the_job() -> None:
    check_job(jobset_configs(custom_resource(JOBSET, "JobSet")))


def test_the_tf_config_checks_catch_a_count_the_cluster_list_does_not_match() -> None:
    jobset = custom_resource(JOBSET, "JobSet")
    workers = jobset["spec"]["replicatedJobs"][2]["template"]["spec"]
    workers["completions"] = workers["parallelism"] = 3  # TF_CLUSTER still lists 2 workers
    with pytest.raises(ConfigError, match='task.index 2 is out of range for 2 "worker" tasks'):
        jobset_configs(jobset)
    tfjob = custom_resource(TFJOB, "TFJob")
    ps = tfjob["spec"]["tfReplicaSpecs"]["PS"]["template"]["spec"]["containers"][0]
    ps["ports"] = [p for p in ps["ports"] if p["name"] != "status"]
    with pytest.raises(AssertionError, match=r"ps 0 declares no port \[2224\]"):
        check_job(tfjob_configs(tfjob))


def test_the_jobset_roles_and_restart_rules_follow_the_job_contract() -> None:
    spec = custom_resource(JOBSET, "JobSet")["spec"]
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["chief"]}
    (rule,) = spec["failurePolicy"]["rules"]
    assert rule["action"] == "FailJobSet" and rule["onJobFailureReasons"] == ["PodFailurePolicy"]
    fail_on = {}
    for rjob in spec["replicatedJobs"]:
        job = rjob["template"]["spec"]
        assert rjob["replicas"] == 1  # task index = completion index (the job index is 0)
        assert job["parallelism"] == job["completions"]  # every task at once
        assert job["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy needs it
        (fail,) = [r for r in job["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
        fail_on[rjob["name"]] = fail["onExitCodes"]["values"]
    # 2 (bad settings) ends the job everywhere; 3 is a failed job from a ps or the chief, and
    # a worker's servers gone away: that worker is retried
    assert fail_on == {"chief": [2, 3], "ps": [2, 3], "worker": [2]}


def test_the_tfjob_restart_policies_follow_the_job_contract() -> None:
    spec = custom_resource(TFJOB, "TFJob")["spec"]
    replicas = spec["tfReplicaSpecs"]
    assert {t: r["replicas"] for t, r in replicas.items()} == {"Chief": 1, "PS": 2, "Worker": 2}
    assert replicas["Worker"]["restartPolicy"] == "OnFailure"
    assert replicas["PS"]["restartPolicy"] == replicas["Chief"]["restartPolicy"] == "ExitCode"
    assert spec["runPolicy"]["cleanPodPolicy"] == "Running"


# ---------------------------------------------------------------- schemas


def test_the_tfjob_matches_the_training_operators_api_models() -> None:
    models("kubeflow.training.models")
    tfjob = custom_resource(TFJOB, "TFJob")
    assert tfjob["apiVersion"] == "kubeflow.org/v1"
    assert openapi_problems(tfjob, "KubeflowOrgV1TFJob", TFJOB_MODELS) == []


def test_the_jobset_matches_the_jobset_api_models() -> None:
    api = models("kubeflow_trainer_api.models")
    jobset = custom_resource(JOBSET, "JobSet")
    assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert pydantic_problems(jobset, api.JobsetV1alpha2JobSet) == []


def test_the_model_checks_catch_unknown_fields_and_wrong_types() -> None:
    models("kubeflow.training.models")
    api = models("kubeflow_trainer_api.models")
    tfjob = custom_resource(TFJOB, "TFJob")
    ps = tfjob["spec"]["tfReplicaSpecs"]["PS"]
    ps["restartPolicies"] = ps.pop("restartPolicy")
    ps["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "2222"
    assert openapi_problems(tfjob, "KubeflowOrgV1TFJob", TFJOB_MODELS) == [
        "spec.tfReplicaSpecs.PS.restartPolicies: unknown field of KubeflowOrgV1ReplicaSpec",
        "spec.tfReplicaSpecs.PS.template.spec.containers[0].ports[0].containerPort: "
        "'2222' is not of type int",
    ]
    jobset = custom_resource(JOBSET, "JobSet")
    jobset["spec"]["network"]["enableDnsHostnames"] = True
    del jobset["spec"]["replicatedJobs"][1]["name"]
    problems = pydantic_problems(jobset, api.JobsetV1alpha2JobSet)
    assert problems[:2] == [
        "spec.network.enableDnsHostnames: unknown field of JobsetV1alpha2Network",
        "spec.replicatedJobs[1].name: required by JobsetV1alpha2ReplicatedJob, missing",
    ]


def pod_templates(tfjob: dict[str, Any], jobset: dict[str, Any]) -> list[dict[str, Any]]:
    """The pods inside the custom resources as core objects kubernetes-validate knows."""
    objects: list[dict[str, Any]] = []
    for rtype, replica in tfjob["spec"]["tfReplicaSpecs"].items():
        meta = {"name": f"tfjob-{rtype.lower()}"}
        template = replica["template"]
        objects.append(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": meta, "template": template}
        )
    for rjob in jobset["spec"]["replicatedJobs"]:
        meta = {"name": f"jobset-{rjob['name']}"}
        spec = rjob["template"]["spec"]
        objects.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec})
    return objects


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_objects_and_the_pod_templates_inside_validate(version: str, tmp_path: Path) -> None:
    validate = tool("kubernetes-validate")
    r = run(validate, "--strict", "-k", version, str(TFJOB), str(JOBSET))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for path in (TFJOB, JOBSET):
        for doc in documents(path):
            if doc["apiVersion"] in ("v1", "apps/v1", "batch/v1"):
                assert f"passed for resource {doc['kind'].lower()}/" in out, out
    templates = pod_templates(custom_resource(TFJOB, "TFJob"), custom_resource(JOBSET, "JobSet"))
    inner = tmp_path / "pods.yaml"
    inner.write_text(yaml.safe_dump_all(templates))
    r = run(validate, "--strict", "-k", version, str(inner))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("passed for resource") == len(templates) == 6, out


def test_the_pod_template_check_catches_a_misspelt_field(tmp_path: Path) -> None:
    tfjob = custom_resource(TFJOB, "TFJob")
    pod = tfjob["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]
    pod["containers"][0]["volumeMount"] = pod["containers"][0].pop("volumeMounts")
    broken = tmp_path / "pods.yaml"
    broken.write_text(yaml.safe_dump_all(pod_templates(tfjob, custom_resource(JOBSET, "JobSet"))))
    r = run(tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSIONS[0], str(broken))
    assert r.returncode != 0 and "volumeMount" in r.stdout + r.stderr
