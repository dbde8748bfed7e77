"""The Helm chart, checked offline: lint, rendered objects, the Serve config against Ray's and our own schema,
pod templates as Kubernetes core objects. Uses the pinned helm binary (tests/helm/helm_binary.py)."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helm.helm_binary import helm_binary

CHART = Path(__file__).resolve().parents[2] / "helm" / "inferscale"
CI_VALUES = CHART / "ci" / "ci-values.yaml"


@pytest.fixture(scope="session")
def helm() -> Path:
    return helm_binary()


def render(helm: Path, *args: str) -> list[dict]:
    done = subprocess.run([str(helm), "template", "rel", str(CHART), "--namespace", "ml", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, [d["kind"] for d in docs]
    return found[0]


def containers(service: dict) -> list[dict]:
    cluster = service["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    return [c for pod in pods for c in pod["spec"]["containers"]]


@pytest.mark.parametrize("values", [[], ["-f", str(CI_VALUES)]], ids=["defaults", "ci-values"])
def test_lint_strict(helm, values):
    done = subprocess.run([str(helm), "lint", "--strict", str(CHART), *values], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_serve_config_names_the_builder_and_validates(helm):
    from ray.serve.schema import ServeDeploySchema

    from deployments.app_args import AppArgs

    service = one(render(helm), "RayService")
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)  # Ray's own schema, as the operator submits it
    app = config["applications"][0]
    assert app["import_path"] == "deployments.ray_serve.app:build_app" and app["route_prefix"] == "/"
    args = AppArgs(**app["args"])  # and the builder's own args model (extra fields are refused)
    assert args.redis_url is None and args.admin_key is None  # both come from Secrets through the environment
    assert str(args.state_dir) == "/var/lib/inferscale" and args.llm.ray_actor_options["num_gpus"] == 1
    assert args.llm.autoscaling_config == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32}
    assert args.llm.tiers.model_dump(mode="json") == {"disk_cache_dir": "/var/cache/inferscale/tiers", "host_cache_bytes": 32 << 30,
                                                      "disk_cache_bytes": 180 << 30, "compress_lower": True,
                                                      "pin_host_at_start": True}
    from config.settings import load_settings

    residency = load_settings(**args.settings).residency  # KV residency: no budget by default, the knobs as given
    assert (residency.memory_kv_bytes, residency.node_kv_bytes, residency.reencode_after_uses) == (None, None, 2)
    service = one(render(helm, "--set", "serve.residency.nodeKvBytes=1000000000000"), "RayService")
    args = AppArgs(**yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"])
    assert load_settings(**args.settings).residency.node_kv_bytes == 10**12


def test_the_ingress_embeds_on_its_cpu_unless_a_gpu_share_is_asked_for_with_room_beside_the_llm(helm):
    from deployments.app_args import AppArgs

    def ingress(*flags: str) -> dict:
        service = one(render(helm, *flags), "RayService")
        return yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]["args"]

    args = ingress()
    assert args["ingress"]["embed_device"] == "cpu" and "num_gpus" not in args["ingress"]["ray_actor_options"]
    assert AppArgs(**args).ingress.query_embedding_way == "process"
    args = ingress("--set", "serve.ingress.embedDevice=cuda", "--set-json", "serve.llm.gpusPerReplica=0.9")
    assert args["ingress"]["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 0.02}
    assert AppArgs(**args).ingress.query_embedding_way == "inline" and args["llm"]["ray_actor_options"]["num_gpus"] == 0.9
    done = subprocess.run([str(helm), "template", "rel", str(CHART), "--set", "serve.ingress.embedDevice=cuda"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "needs GPU room beside the LLM replicas" in done.stderr


def test_the_offload_tier_gets_a_node_local_disk_on_gpu_workers_or_is_off(helm):
    cluster = one(render(helm), "RayService")["spec"]["rayClusterConfig"]
    (gpu,) = [g for g in cluster["workerGroupSpecs"] if g["groupName"] == "gpu"]
    assert {"name": "tiers", "mountPath": "/var/cache/inferscale/tiers"} in gpu["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "tiers", "emptyDir": {"sizeLimit": "200Gi"}} in gpu["template"]["spec"]["volumes"]
    lazy = one(render(helm, "--set", "serve.llm.offload.pinHostAtStart=false"), "RayService")
    assert yaml.safe_load(lazy["spec"]["serveConfigV2"])["applications"][0]["args"]["llm"]["tiers"]["pin_host_at_start"] is False
    off = one(render(helm, "--set", "serve.llm.offload.enabled=false"), "RayService")
    assert "tiers" not in yaml.safe_load(off["spec"]["serveConfigV2"])["applications"][0]["args"]["llm"]
    assert all(v["name"] != "tiers" for g in off["spec"]["rayClusterConfig"]["workerGroupSpecs"]
               for v in g["template"]["spec"]["volumes"])


def test_serve_runs_in_high_throughput_mode_on_every_node_and_only_the_ingress_port_is_exposed(helm):
    docs = render(helm)
    service = one(docs, "RayService")
    for container in containers(service):  # Ray reads the switches when it starts: head and workers alike
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert (env["RAY_SERVE_ENABLE_HA_PROXY"], env["RAY_SERVE_THROUGHPUT_OPTIMIZED"], env["INFERSCALE_SERVE__PROXY"]) == ("1", "1", "haproxy")
    assert [p["port"] for p in service["spec"]["serveService"]["spec"]["ports"]] == [8000]
    assert not [d for d in docs if d["kind"] == "Service" and "serve" in d["metadata"]["name"]]  # no other Service for Serve
    back = one(render(helm, "--set", "serve.proxy=python"), "RayService")
    for container in containers(back):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert (env["RAY_SERVE_ENABLE_HA_PROXY"], env["RAY_SERVE_THROUGHPUT_OPTIMIZED"]) == ("0", "0")


def test_gpu_workers_request_their_gpus_and_autoscale(helm):
    docs = render(helm, "-f", str(CI_VALUES))
    cluster = one(docs, "RayService")["spec"]["rayClusterConfig"]
    (gpu,) = [g for g in cluster["workerGroupSpecs"] if g["groupName"] == "gpu"]
    worker = gpu["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2 and worker["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert (gpu["minReplicas"], gpu["replicas"], gpu["maxReplicas"]) == (1, 2, 8)
    assert gpu["rayStartParams"]["num-gpus"] == "2" and cluster["enableInTreeAutoscaling"] is True
    assert gpu["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    assert worker["image"] == "ghcr.io/inferscale/inferscale:0.1.0-ci"
    args = yaml.safe_load(one(docs, "RayService")["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["llm"]["engine_kwargs"]["tensor_parallel_size"] == 2 and args["llm"]["ray_actor_options"]["num_gpus"] == 2
    assert [g["groupName"] for g in cluster["workerGroupSpecs"]] == ["gpu"]  # cpuWorkers disabled


def test_redis_is_persistent_with_aof_and_its_password_comes_from_a_secret(helm):
    docs = render(helm)
    redis = one(docs, "StatefulSet")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    command = " ".join(container["command"])
    assert "--appendonly yes" in command and '--requirepass "$REDIS_PASSWORD"' in command
    assert container["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "rel-inferscale-redis", "key": "redis-password"}
    claim = redis["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]


def test_secrets_are_referenced_never_inlined(helm):
    docs = render(helm)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    admin = base64.b64decode(secrets["rel-inferscale-admin"]["data"]["admin-key"]).decode()
    password = base64.b64decode(secrets["rel-inferscale-redis"]["data"]["redis-password"]).decode()
    assert admin.startswith("isa.") and len(admin) > 40 and len(password) >= 32
    rest = yaml.safe_dump([d for d in docs if d["kind"] != "Secret"])
    assert admin not in rest and password not in rest
    for container in containers(one(docs, "RayService")):
        env = {e["name"]: e for e in container["env"]}
        assert env["INFERSCALE_ADMIN_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "rel-inferscale-admin", "key": "admin-key"}
        assert env["INFERSCALE_REDIS__URL"]["value"] == "redis://:$(REDIS_PASSWORD)@rel-inferscale-redis:6379/0"
        assert list(env).index("REDIS_PASSWORD") < list(env).index("INFERSCALE_REDIS__URL")  # expansion order


def test_existing_secrets_and_external_redis_render_no_secret_and_no_redis(helm):
    docs = render(helm, "-f", str(CI_VALUES))
    kinds = [d["kind"] for d in docs]
    assert "Secret" not in kinds and "StatefulSet" not in kinds and "PersistentVolumeClaim" not in kinds
    for container in containers(one(docs, "RayService")):
        env = {e["name"]: e for e in container["env"]}
        assert env["INFERSCALE_REDIS__URL"]["valueFrom"]["secretKeyRef"] == {"name": "inferscale-redis-url", "key": "redis-url"}
        assert env["INFERSCALE_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "inferscale-admin"
        assert {"name": "state", "mountPath": "/var/lib/inferscale"} in container["volumeMounts"]


def test_external_redis_needs_its_url_secret(helm):
    done = subprocess.run([str(helm), "template", "rel", str(CHART), "--set", "redis.enabled=false"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "redis.external.urlSecret is required" in done.stderr


@pytest.mark.parametrize("bad", ["gpuWorkers.gpus=0", "serve.llm.onLoadFailure=ignore", "redis.appendfsync=sometimes",
                                 "encodeJob.tenant=Bad_Name", "state.mountPath=relative",
                                 "serve.llm.offload.diskSizeLimit=lots", "serve.proxy=nginx",
                                 "serve.residency.memoryKvBytes=-1", "serve.ingress.embedDevice=tpu",
                                 "serve.ingress.gpuShare=0"])
def test_schema_refuses_bad_values(helm, bad):
    done = subprocess.run([str(helm), "template", "rel", str(CHART), "--set", bad], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "values don't meet the specifications of the schema" in done.stderr


def test_encoding_rayjob_runs_inferscale_encode_for_the_tenant(helm):
    job = one(render(helm, "-f", str(CI_VALUES)), "RayJob")
    assert job["metadata"]["name"] == "rel-inferscale-encode-alice"
    assert job["spec"]["entrypoint"] == "inferscale encode --tenant alice --input /inferscale/input/input.json --workers 2 --window 5"
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert {"name": "input", "configMap": {"name": "alice-conversation"}} in head["volumes"]
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert worker["replicas"] == 2 and worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert job["spec"]["shutdownAfterJobFinishes"] is True


def test_ingress_and_service_monitor_point_at_the_serve_service(helm):
    docs = render(helm, "-f", str(CI_VALUES))
    service = one(docs, "RayService")["spec"]["serveService"]
    ingress = one(docs, "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": service["metadata"]["name"], "port": {"number": 8000}}
    assert ingress["spec"]["tls"][0]["secretName"] == "inferscale-tls"
    monitor = one(docs, "ServiceMonitor")
    assert all(service["metadata"]["labels"][k] == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


@pytest.mark.parametrize("values", [[], ["-f", str(CI_VALUES)]], ids=["defaults", "ci-values"])
def test_pod_templates_and_core_objects_validate_as_kubernetes(helm, values):
    import kubernetes_validate

    docs = render(helm, *values)
    core = [d for d in docs if d["kind"] in ("Secret", "Service", "StatefulSet", "PersistentVolumeClaim", "Ingress")]
    pods = []
    for doc in docs:
        if doc["kind"] == "RayService":
            cluster = doc["spec"]["rayClusterConfig"]
            pods += [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
        if doc["kind"] == "RayJob":
            cluster = doc["spec"]["rayClusterSpec"]
            pods += [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    assert pods and core
    for i, template in enumerate(pods):
        core.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"pod-{i}"}, "template": template})
    for doc in core:
        kubernetes_validate.validate(doc, "1.30", strict=True)
    broken = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
              "template": {"spec": {"containers": [{"image": "x", "bogus": 1}]}}}
    with pytest.raises(kubernetes_validate.ValidationError):  # the validator does catch a bad pod template
        kubernetes_validate.validate(broken, "1.30", strict=True)
