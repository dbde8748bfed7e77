"""A serving cluster started inside a benchmark's process: redis-server, local Ray, the Serve app (SmolLM2 on
CPU, CUDA vLLM on a GPU, or a model shape with dummy weights), so measurements run against the real stack."""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from benchmarks._common import scratch_dir


def shaped_model(config_path: Path, into: Path, early_layers: int = 0) -> tuple[str, str]:
    """A model folder: the shape's config (SmolLM2's vocabulary and special ids) and SmolLM2's tokenizer; with
    `early_layers`, random weights of the embedding and that many first layers in bf16 (what history mode's
    question pass reads; the engine itself loads dummy weights and never reads them)."""
    from config import load_settings
    from models.loader import model_path

    bundled = model_path(load_settings().model)
    config = json.loads(config_path.read_text())
    own = json.loads((bundled / "config.json").read_text())
    config.update({key: own[key] for key in ("vocab_size", "bos_token_id", "eos_token_id") if key in own})
    into.mkdir(parents=True)
    (into / "config.json").write_text(json.dumps(config))
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "chat_template.jinja",
    ):
        if (bundled / name).exists():
            shutil.copy(bundled / name, into / name)
    if early_layers:
        write_early_layers(config, into / "model.safetensors", early_layers)
    return str(into), "dummy-" + hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def write_early_layers(config: dict, path: Path, layers: int, seed: int = 0) -> None:
    """Random bf16 weights (std 0.02, norms at one) of a Llama shape's embedding and first `layers` layers, named as
    a checkpoint names them."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, head_dim = config["num_attention_heads"], config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = (config.get("num_key_value_heads") or heads) * head_dim

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": weight(config["vocab_size"], hidden)}
    for i in range(layers):
        at = f"model.layers.{i}."
        tensors |= {
            at + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            at + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            at + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            at + "self_attn.k_proj.weight": weight(kv, hidden),
            at + "self_attn.v_proj.weight": weight(kv, hidden),
            at + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            at + "mlp.gate_proj.weight": weight(inter, hidden),
            at + "mlp.up_proj.weight": weight(inter, hidden),
            at + "mlp.down_proj.weight": weight(hidden, inter),
        }
    save_file(tensors, str(path))


ERRORS_ENV = "SERVE_ERRORS_LOG"  # a file that gets the serving cluster's error lines when the benchmark exits
ERROR_MARKS = (
    "Traceback",
    "Fatal Python error",
    "terminate called",
    "capture failed",
    "device arena",
    "query embedder",
)


def keep_errors(out: Path, *ray_temps: Path, before: int = 2, after: int = 30) -> None:
    """Write the lines around every error mark in the clusters' logs (replicas' stderr, Serve's logs) to `out`:
    the logs go with Ray's scratch folder, and a replica's traceback is often the only account of a 500
    (`gpu_suite.sh` also runs this over the folders a run cut by its time limit left behind)."""
    blocks = []
    logs = [
        path
        for ray_temp in ray_temps
        for pattern in ("session_*/logs/*.err", "session_*/logs/serve/*.log")
        for path in sorted(ray_temp.glob(pattern))
    ]
    for path in logs:
        lines = path.read_text(errors="replace").splitlines()
        marked = [i for i, line in enumerate(lines) if any(mark in line for mark in ERROR_MARKS)]
        shown = -1
        for i in marked:
            if i <= shown:
                continue
            shown = min(len(lines) - 1, i + after)
            blocks.append(f"== {path.name}:{i + 1}\n" + "\n".join(lines[max(0, i - before) : shown + 1]))
    out.write_text("\n".join(blocks) + ("\n" if blocks else ""))


DRAIN_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"


def start_local_serve(proxy: str, num_cpus: int, busy_polling: bool = False) -> int:
    """A local Ray (loopback only) with Serve in `proxy` mode started in this process (HAProxy's threads busy
    polling with `busy_polling`); returns the HTTP port. Ray reads the mode as it starts, so nothing of Ray may
    have started in this process before."""
    import os

    from cluster.ray_head import LOOPBACK_ENV, free_port
    from deployments.ray_serve.serve_mode import apply_serve_env

    os.environ.update(LOOPBACK_ENV)
    # a benchmark's cluster serves nothing once it stops: its ingress need not drain for Serve's 30 s (each GPU run
    # spent them at every stop, one step cut at its time limit there)
    os.environ.setdefault(DRAIN_ENV, "1")
    temp_dir = scratch_dir(prefix="ray-", dir="/tmp")  # short: Ray's and HAProxy's unix sockets live under it
    if os.environ.get(ERRORS_ENV):  # registered after the folder's removal, so it runs before it
        atexit.register(keep_errors, Path(os.environ[ERRORS_ENV]), Path(temp_dir))
    apply_serve_env(proxy, Path(temp_dir) / "serve", busy_polling)  # type: ignore[arg-type]
    import ray  # only now: Ray Serve reads the mode's switches when it is first imported
    from ray import serve

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=temp_dir,
        _node_ip_address="127.0.0.1",
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


LLM_GPU_SHARE = 0.9  # of the one GPU: the LLM replica's
INGRESS_GPU_SHARE = 0.08  # what all ingress replicas embed queries in, together


def ingress_gpu_share(replicas: int) -> float:
    """Each ingress replica's share of the GPU: 0.02, or less where that many would ask for more than their part
    (eight at 0.02 beside the LLM's 0.9 asked for 1.06 GPUs, and Serve waited for room that never came)."""
    if replicas < 1:
        raise ValueError(f"ingress replicas must be at least 1, got {replicas}")
    return min(0.02, INGRESS_GPU_SHARE / replicas)


def served_block_size(app_args: dict, cuda: bool) -> int | None:
    """The KV block size the app's engine runs with (None: vLLM's own default)."""
    from deployments.app_args import AppArgs

    return AppArgs(**app_args).engine_kwargs(cuda).get("block_size")


def start_cluster(
    state: Path,
    cuda: bool,
    shape: Path | None,
    proxy: str = "haproxy",
    embed_device: str = "cuda",
    engine_sm_percent: int | None = None,
    query_embedding: str = "auto",
    engine_kwargs: dict | None = None,
    llm_args: dict | None = None,
    early_layers: int = 0,
    ingress_replicas: int = 4,
    chat_transport: str = "auto",
    spin_ms: float = 0.0,
    ingress_apps: int = 1,
):
    """(base URL, admin key, redis, app args) of a cluster started in this process with Serve's `proxy` mode;
    on a GPU the ingress embeds queries on `embed_device` (on the CPU with two threads a replica), and under
    CUDA's multi-process service `engine_sm_percent` holds the engine to that share of the SMs (the rest stay
    free for the ingress's query embeddings); `query_embedding`: the ingress embeds questions from its event
    loop, in a process of its own or in a thread (`ingress.query_embedding`; auto: inline on a GPU);
    `engine_kwargs` go to vLLM over the defaults (a longer context, say), `llm_args` to
    the LLM deployment over its defaults; a shape gets random weights of its first `early_layers` layers; on a GPU
    `ingress_replicas` ingress replicas (each one event loop: more of them, less time a request waits for one);
    `chat_transport`: how chats reach the LLM replica (`ingress.chat_transport`: its channel, or Serve's handle);
    `spin_ms`: how long the query embedder's process and the ingress's loop poll instead of sleeping around a
    question (`ingress.embed_spin_ms`), and the LLM replica's loop after a note until its chat
    (`llm.ahead_spin_ms`); `ingress_apps`: how many ingress applications will share the GPU's ingress share
    (`deploy_second_ingress` adds the second)."""
    import os

    from ray import serve

    from cluster.redis_server import LocalRedis
    from deployments.ray_serve.app import build_app
    from tenants.auth import new_admin_key

    redis = LocalRedis(state / "redis").start()
    port, admin = start_local_serve(proxy, num_cpus=max(8, os.cpu_count() or 1)), new_admin_key()
    # a compile cache named in the environment outlives the run (a GPU machine's later calls start faster)
    env = {"VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT") or str(state / "vllm-cache")}
    env |= {} if cuda else {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    env |= {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(engine_sm_percent)} if engine_sm_percent else {}
    # how many of a step's outputs vLLM's frontend hands out before the replica's event loop reads new chats again
    # (vLLM's default 128: a step finishing 100 chats holds every chat that arrives meanwhile until all 100 are sent)
    env |= {key: os.environ[key] for key in ("VLLM_V1_OUTPUT_PROC_CHUNK_SIZE",) if key in os.environ}
    llm = {
        "dtype": "bfloat16" if cuda else "float32",
        "env": env,
        "max_ongoing_requests": 256,
        "ahead_spin_ms": min(spin_ms, 20.0),  # the note's chat follows within ms: its setting stops at 20
        "ray_actor_options": {"num_cpus": 1, "num_gpus": LLM_GPU_SHARE} if cuda else {"num_cpus": 1},
    }
    ingress = {
        "rate_per_s": 10_000,
        "burst": 10_000,
        "max_ongoing_requests": 512,
        "first_event_timeout_s": 900,
        "query_embedding": query_embedding,
        "chat_transport": chat_transport,
        "embed_spin_ms": spin_ms,
    }  # a cold start of 100 tenants reads ~40 GB of records: not a lost replica
    if cuda:  # the GPU also embeds queries (a sliver of it per ingress replica), as a GPU deployment would
        llm["engine_kwargs"] = {"gpu_memory_utilization": 0.45, "max_model_len": 4096}
        # every tenant's facts stay hot in HBM, as for active tenants: records in the served bf16 (the default),
        # 100 tenants x 51 records of two 16-token pages at the 8B shape's 128 KiB a token come to ~20 GiB; 48 GiB
        # on an H200, less on a smaller card (an H100's 80 GB did not hold it beside the engine's 0.45 and the
        # reference engine's arena: 2026-12-05)
        llm["device_cache_bytes"] = card_arena_bytes(48 << 30)
        llm["max_encodes_in_flight"] = 32  # 5,000 facts to encode before anything is measured
        ingress |= {
            "num_replicas": ingress_replicas,
            "embed_device": embed_device,
            "ray_actor_options": {"num_cpus": 1, "num_gpus": ingress_gpu_share(ingress_apps * ingress_replicas)}
            if embed_device == "cuda"
            else {"num_cpus": 2},
        }
    if shape is not None:
        path, fingerprint = shaped_model(shape, state / "model", early_layers)
        llm |= {"model": path, "fingerprint": fingerprint}
        llm["engine_kwargs"] = {**llm.get("engine_kwargs", {}), "load_format": "dummy", "dtype": llm["dtype"]}
    if engine_kwargs:
        llm["engine_kwargs"] = {**llm.get("engine_kwargs", {}), **engine_kwargs}
    llm |= llm_args or {}
    args = {"redis_url": redis.url, "state_dir": str(state), "admin_key": admin, "llm": llm, "ingress": ingress}
    serve.run(build_app(args), name="inferscale", route_prefix="/")
    return f"http://127.0.0.1:{port}", admin, redis, args


def deploy_second_ingress(app_args: dict, overrides: dict, route_prefix: str = "/b") -> str:
    """A second ingress application over the running app's LLM replicas, its ingress args with `overrides`, under
    `route_prefix` (returned): two ingress settings served side by side by one engine, for requests interleaved
    between them (start the cluster with `ingress_apps=2`, so both fit the GPU's ingress share)."""
    from ray import serve

    from deployments.ray_serve.app import build_ingress

    args = {**app_args, "ingress": {**app_args["ingress"], **overrides}}
    llm = serve.get_deployment_handle("LLMServer", app_name="inferscale")
    serve.run(build_ingress(args, llm, name="IngressB"), name="inferscale-b", route_prefix=route_prefix)
    return route_prefix


def card_arena_bytes(most: int) -> int:
    """A device arena beside the engine's 0.45 of the card: 0.3 of the first visible GPU's memory, `most` at most."""
    return min(most, int(0.3 * gpu_memory_bytes()))


def gpu_memory_bytes() -> int:
    """The first visible GPU's memory, asked of nvidia-smi (this process keeps no CUDA context of its own for it;
    nvidia-smi numbers GPUs as the machine does, so the first of CUDA_VISIBLE_DEVICES is named)."""
    import os
    import subprocess

    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip() or "0"
    mib = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", f"--id={first}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return int(mib.strip()) << 20


@contextmanager
def cluster_for(
    base_url: str | None,
    admin_key: str | None,
    name: str,
    cuda: bool = False,
    engine_kwargs: dict | None = None,
    llm_args: dict | None = None,
) -> Iterator[tuple[str, str]]:
    """(base URL, admin key) of the given cluster, or of one started here for the duration (then stopped);
    `engine_kwargs`, `llm_args`: the started one's (a given cluster runs with its own)."""
    if base_url:
        if not admin_key:
            from config import load_settings

            admin_key = load_settings().admin_key
        if not admin_key:
            raise SystemExit("an admin key is needed with --base-url (--admin-key or INFERSCALE_ADMIN_KEY)")
        yield base_url.rstrip("/"), admin_key
        return
    base, admin, redis, _ = start_cluster(
        Path(scratch_dir(prefix=f"{name}-")), cuda=cuda, shape=None, engine_kwargs=engine_kwargs, llm_args=llm_args
    )
    try:
        yield base, admin
    finally:
        from ray import serve

        serve.shutdown()
        redis.stop()
